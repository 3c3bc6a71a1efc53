"""COCO reading and evaluation: ground truth scores AP 1.0 against itself, known box shifts lower it predictably."""

import pytest
import torch

pytest.importorskip("pycocotools")

from hpdl.runtime.errors import HpdlError  # noqa: E402
from hpdl.vision.coco import CocoInstances, coco_evaluate, collate, find_split, hflip, to_coco_results  # noqa: E402
from hpdl.vision.shapes import ShapesConfig, make_shapes  # noqa: E402


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    make_shapes(root, ShapesConfig(num_train=8, num_val=6, image_size=64, max_instances=4))
    return root


def _gt_outputs(ds, shift_frac=0.0):
    outs, ids = [], []
    for i in range(len(ds)):
        _, t = ds[i]
        boxes = t["boxes"].clone()
        w = boxes[:, 2] - boxes[:, 0]
        boxes[:, [0, 2]] += shift_frac * w[:, None]
        outs.append({"boxes": boxes, "labels": t["labels"], "scores": torch.ones(len(boxes)),
                     "masks": t["masks"][:, None].bool()})
        ids.append(int(t["image_id"]))
    return outs, ids


def test_dataset_items_are_in_torchvision_detection_format(shapes):
    ds = CocoInstances(shapes, "val")
    assert len(ds) == 6 and ds.num_classes == 4 and ds.class_names[1:] == ["circle", "triangle", "square"]
    image, t = ds[0]
    assert image.shape == (3, 64, 64) and image.dtype == torch.float32 and 0 <= image.min() <= image.max() <= 1
    n = len(t["boxes"])
    assert n >= 1 and t["boxes"].shape == (n, 4) and t["labels"].dtype == torch.int64
    assert t["masks"].shape == (n, 64, 64) and t["masks"].dtype == torch.uint8
    for box, mask in zip(t["boxes"], t["masks"]):     # the shapes set's boxes are tight boxes of the masks
        ys, xs = torch.nonzero(mask, as_tuple=True)
        assert box.tolist() == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
    images, targets = collate([ds[0], ds[1]])
    assert isinstance(images, list) and len(targets) == 2


def test_hflip_moves_boxes_with_their_masks(shapes):
    image, t = CocoInstances(shapes, "val")[1]
    fimage, ft = hflip(image, t)
    assert torch.equal(fimage.flip(-1), image)
    for box, mask in zip(ft["boxes"], ft["masks"]):
        ys, xs = torch.nonzero(mask, as_tuple=True)
        assert box.tolist() == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]


def test_ground_truth_against_itself_scores_ap_one(shapes):
    ds = CocoInstances(shapes, "val")
    outs, ids = _gt_outputs(ds)
    metrics = coco_evaluate(ds.coco, to_coco_results(outs, ids, ds.cat_ids))
    assert metrics["bbox"]["AP"] == 1.0 and metrics["segm"]["AP"] == 1.0
    assert metrics["bbox"]["AP50"] == 1.0 and metrics["segm"]["AP75"] == 1.0


def test_a_known_box_shift_lowers_box_ap_predictably(shapes):
    ds = CocoInstances(shapes, "val")
    outs, ids = _gt_outputs(ds, shift_frac=0.1)    # IoU = 0.9 / 1.1 = 0.818 for every box
    box = coco_evaluate(ds.coco, to_coco_results(outs, ids, ds.cat_ids), ("bbox",))["bbox"]
    assert box["AP50"] == 1.0 and box["AP75"] == 1.0
    assert box["AP"] == pytest.approx(0.7, abs=1e-9)  # thresholds 0.50..0.80 of 0.50..0.95 pass


def test_empty_or_maskless_results_score_zero(shapes):
    ds = CocoInstances(shapes, "val")
    assert coco_evaluate(ds.coco, [])["segm"]["AP"] == 0.0
    outs, ids = _gt_outputs(ds)
    for o in outs:
        del o["masks"]
    m = coco_evaluate(ds.coco, to_coco_results(outs, ids, ds.cat_ids))
    assert m["bbox"]["AP"] == 1.0 and m["segm"]["AP"] == 0.0


def test_missing_split_is_named(tmp_path):
    with pytest.raises(HpdlError, match="no COCO split 'val'"):
        find_split(tmp_path, "val")


def test_background_label_is_left_out_and_bad_labels_are_named(shapes):
    # RetinaNet-style heads (torchvision's RetinaNet, SPRNet) score class 0 like any other: it used to become
    # the last category (cat_ids[-1]), a false positive there
    ds = CocoInstances(shapes, "val")
    box = torch.tensor([[1.0, 1.0, 20.0, 20.0], [2.0, 2.0, 30.0, 30.0]])
    out = [{"boxes": box, "labels": torch.tensor([0, 1]), "scores": torch.tensor([0.9, 0.8])}]
    res = to_coco_results(out, [ds.ids[0]], ds.cat_ids)
    assert [r["category_id"] for r in res] == [ds.cat_ids[0]] and res[0]["bbox"] == [2.0, 2.0, 28.0, 28.0]
    with pytest.raises(ValueError, match=r"outputs\[0\] has label 4; labels must be 1..3"):
        to_coco_results([dict(out[0], labels=torch.tensor([1, 4]))], [ds.ids[0]], ds.cat_ids)


def test_empty_results_score_as_pycocotools_scores_no_detections(shapes):
    # oracle: pycocotools itself, given only a detection of a category the split does not have (ignored)
    from pycocotools.cocoeval import COCOeval

    from hpdl.vision.coco import AP_KEYS, _quiet

    ds = CocoInstances(shapes, "val")
    with _quiet():
        dt = ds.coco.loadRes([{"image_id": ds.ids[0], "category_id": 999, "bbox": [0, 0, 5, 5], "score": 1.0}])
        ev = COCOeval(ds.coco, dt, "bbox")
        ev.evaluate(), ev.accumulate(), ev.summarize()
    want = dict(zip(AP_KEYS, map(float, ev.stats[:6])))
    assert -1.0 in want.values()          # the 64-pixel set has no large objects: -1, not 0
    got = coco_evaluate(ds.coco, [])
    assert got["bbox"] == want and got["segm"] == want


def _edited(shapes, tmp_path, edit):
    import json
    import shutil

    root = tmp_path / "d"
    shutil.copytree(shapes, root)
    ann = root / "annotations" / "instances_val.json"
    data = json.loads(ann.read_text())
    edit(data, root)
    ann.write_text(json.dumps(data))
    return root


@pytest.mark.parametrize("edit, msg", [
    (lambda d, r: d.pop("categories"), "no 'categories' list"),
    (lambda d, r: d["annotations"][0].pop("bbox"), r"annotation 1 needs 'bbox' as 4 finite numbers"),
    (lambda d, r: d["annotations"][0].pop("segmentation"), "annotation 1 has no 'segmentation'"),
    (lambda d, r: d["annotations"][0].__setitem__("category_id", 99), r"category_id 99; the categories are \[1, 2, 3\]"),
    (lambda d, r: d["annotations"][0].__setitem__("image_id", 999), "image_id 999, not an image"),
    (lambda d, r: [i.pop("height") for i in d["images"]], r"lacks \['height'\]"),
    (lambda d, r: [i.__setitem__("id", str(i["id"])) for i in d["images"]], "is not an integer"),
])
def test_malformed_annotation_files_are_named_at_construction(shapes, tmp_path, edit, msg):
    """These were KeyErrors or TypeErrors when a loader worker first read the sample."""
    with pytest.raises(HpdlError, match=msg):
        CocoInstances(_edited(shapes, tmp_path, edit), "val")


def test_an_image_of_another_size_than_its_entry_is_named_not_emptied(shapes, tmp_path):
    """Every mask of such an image failed the size check and was dropped: it trained as pure background."""
    from PIL import Image

    def shrink(d, root):
        f = root / "val" / d["images"][0]["file_name"]
        Image.open(f).resize((80, 60)).save(f)

    ds = CocoInstances(_edited(shapes, tmp_path, shrink), "val")
    with pytest.raises(HpdlError, match=r"is 80x60 pixels but instances_val.json says 64x64"):
        ds[0]


def test_an_empty_polygon_is_an_empty_mask_and_evaluation_still_runs(shapes, tmp_path):
    """pycocotools raised IndexError decoding ``segmentation: []``, in the reader and in COCOeval."""
    def empty(d, root):
        d["annotations"][0]["segmentation"] = []

    ds = CocoInstances(_edited(shapes, tmp_path, empty), "val")
    ref = CocoInstances(shapes, "val")
    first = ds.coco.anns[ds.coco.getAnnIds()[0]]["image_id"]
    k = ds.ids.index(first)
    assert len(ds[k][1]["boxes"]) == len(ref[k][1]["boxes"]) - 1      # the empty instance is left out
    outs, ids = _gt_outputs(ds)
    metrics = coco_evaluate(ds.coco, to_coco_results(outs, ids, ds.cat_ids))
    assert 0.8 < metrics["segm"]["AP"] <= 1.0


def test_segm_size_buckets_use_the_mask_area_not_the_box(shapes):
    """A small false-positive mask whose result carries a large bbox: pycocotools takes a result's area from
    its bbox when it has one, so that mask was sorted out of APs as 'medium' and APs stayed 1.0."""
    ds = CocoInstances(shapes, "val")
    outs, ids = _gt_outputs(ds)
    o = outs[0]
    fp = torch.zeros(1, 1, 64, 64, dtype=torch.bool)
    fp[0, 0, :2, :2] = True                              # 4 pixels: small, overlapping nothing much
    outs[0] = {"boxes": torch.cat([torch.tensor([[0.0, 0, 64, 64]]), o["boxes"]]),    # box area 4096: medium
               "labels": torch.cat([o["labels"][:1], o["labels"]]), "scores": torch.ones(len(o["boxes"]) + 1),
               "masks": torch.cat([fp, o["masks"]])}
    results = to_coco_results(outs, ids, ds.cat_ids)
    assert all("bbox" in r for r in results)             # box AP still has its boxes
    segm = coco_evaluate(ds.coco, results, ("segm",))["segm"]
    assert segm["APm"] == -1.0                           # the split has no medium object
    assert segm["APs"] < 1.0 and segm["AP"] == segm["APs"]   # the small false positive counts, as a small mask
