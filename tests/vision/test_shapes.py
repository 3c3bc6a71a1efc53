"""The synthetic COCO-format shapes set: deterministic by seed, exact masks, COCO fields consistent."""

import json

import numpy as np
import pytest

pytest.importorskip("pycocotools")

from pycocotools import mask as mask_utils  # noqa: E402

from hpdl.vision.shapes import CLASSES, ShapesConfig, make_shapes, render_image  # noqa: E402

CFG = ShapesConfig(num_train=12, num_val=4, image_size=64, max_instances=4)


def test_same_seed_same_files_other_seed_other_images(tmp_path):
    a = make_shapes(tmp_path / "a", CFG)
    b = make_shapes(tmp_path / "b", CFG)
    c = make_shapes(tmp_path / "c", ShapesConfig(**{**CFG.__dict__, "seed": 1}))
    for split in ("train", "val"):
        assert a[split].read_text() == b[split].read_text()
        for i in range(CFG.num_val):
            assert (tmp_path / "a" / split / f"{i:06d}.png").read_bytes() == \
                (tmp_path / "b" / split / f"{i:06d}.png").read_bytes()
    assert a["train"].read_text() != c["train"].read_text()
    # each image depends only on (seed, split, index): a larger set starts with the same images
    big = make_shapes(tmp_path / "big", ShapesConfig(**{**CFG.__dict__, "num_train": 20}))
    assert json.loads(big["train"].read_text())["images"][:12] == json.loads(a["train"].read_text())["images"]
    assert (tmp_path / "big" / "train" / "000011.png").read_bytes() == \
        (tmp_path / "a" / "train" / "000011.png").read_bytes()


def test_masks_are_exact_disjoint_visible_pixels_of_their_shapes():
    for i in range(10):
        image, instances = render_image(CFG, "train", i)
        assert image.shape == (64, 64, 3) and image.dtype == np.uint8
        assert CFG.min_instances <= len(instances) <= CFG.max_instances
        union = np.zeros((64, 64), dtype=int)
        for kind, mask in instances:
            assert 0 <= kind < len(CLASSES) and mask.any()
            union += mask
        assert union.max() <= 1                      # visible masks never overlap
        # every visible pixel of a later-drawn instance shows its colour: pixels of one mask share a colour
        # cluster apart from the pixels just outside it
        for _, mask in instances:
            inside = image[mask].astype(float).mean(0)
            assert np.abs(image[mask].astype(float) - inside).mean() < 20


def test_coco_annotations_match_the_masks(tmp_path):
    files = make_shapes(tmp_path, CFG)
    data = json.loads(files["val"].read_text())
    assert [c["name"] for c in data["categories"]] == list(CLASSES) and data["categories"][0]["id"] == 1
    assert len(data["images"]) == CFG.num_val
    ids = [a["id"] for a in data["annotations"]]
    assert ids == list(range(1, len(ids) + 1))
    by_image = {}
    for a in data["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    for img in data["images"]:
        _, instances = render_image(CFG, "val", img["id"] - 1)
        anns = by_image[img["id"]]
        assert len(anns) == len(instances)
        for a, (kind, mask) in zip(anns, instances):
            rle = {"size": a["segmentation"]["size"], "counts": a["segmentation"]["counts"].encode()}
            assert np.array_equal(mask_utils.decode(rle).astype(bool), mask)
            assert a["category_id"] == kind + 1 and a["area"] == mask.sum() and a["iscrowd"] == 0
            ys, xs = np.nonzero(mask)
            assert a["bbox"] == [xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1]


def test_bad_config_is_named():
    for kw, msg in (({"image_size": 8}, "image_size"), ({"classes": ("hexagon",)}, "classes"),
                    ({"min_instances": 3, "max_instances": 2}, "min_instances"), ({"num_val": -1}, "num_val")):
        with pytest.raises(ValueError, match=msg):
            ShapesConfig(**kw)


def test_another_set_in_root_is_refused_not_overwritten_and_overwrite_removes_its_images(tmp_path):
    """make-shapes into a folder holding another set silently replaced its annotations and left the old set's
    extra images lying beside the new annotations."""
    from hpdl.runtime.errors import HpdlError

    small = ShapesConfig(num_train=3, num_val=2, image_size=32)
    make_shapes(tmp_path, small)
    before = (tmp_path / "annotations" / "instances_train.json").read_text()
    make_shapes(tmp_path, small)                                   # the same set again: fine, identical
    assert (tmp_path / "annotations" / "instances_train.json").read_text() == before
    other = ShapesConfig(num_train=2, num_val=1, image_size=32, seed=4)
    with pytest.raises(HpdlError, match="instances_train.json is not this shapes set.*overwrite"):
        make_shapes(tmp_path, other)
    assert (tmp_path / "annotations" / "instances_train.json").read_text() == before
    make_shapes(tmp_path, other, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["000000.png", "000001.png"]
    assert sorted(p.name for p in (tmp_path / "val").iterdir()) == ["000000.png"]
    stray = tmp_path / "stray"
    (stray / "train").mkdir(parents=True)
    (stray / "train" / "mine.jpg").write_bytes(b"x")
    with pytest.raises(HpdlError, match="holds files and no shapes annotations"):
        make_shapes(stray, small)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        ShapesConfig(seed=-1)


@pytest.mark.parametrize("flag, value", [("--train", "-1"), ("--val", "-3"), ("--image-size", "8"),
                                         ("--max-instances", "0"), ("--seed", "-1"), ("--workers", "-1")])
def test_make_shapes_flags_are_checked_by_the_parser(flag, value, tmp_path, capsys):
    """--workers -1 rendered in-process silently; --seed -1 failed in numpy without naming the flag."""
    from hpdl.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["vision", "make-shapes", "--root", str(tmp_path / "r"), "--train", "1", "--val", "1", "--image-size",
              "16", flag, value])
    assert exc.value.code == 2 and flag in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
