"""hpdl.vision.datasets: the procedural shapes set is deterministic, balanced and written as an ImageFolder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpdl.vision.datasets import SHAPE_CLASSES, Shapes, classification_transforms, image_folder, write_shapes


def test_shapes_are_deterministic_balanced_and_distinct():
    a, b = Shapes(20, 32, seed=3), Shapes(20, 32, seed=3)
    assert [y for _, y in (a[i] for i in range(20))] == [i % 10 for i in range(20)]
    assert np.array_equal(np.asarray(a[7][0]), np.asarray(b[7][0]))
    assert not np.array_equal(np.asarray(a[7][0]), np.asarray(Shapes(20, 32, seed=4)[7][0]))
    x, _ = Shapes(4, 48, transform=classification_transforms(32, True))[0]
    assert tuple(x.shape) == (3, 32, 32)
    with pytest.raises(ValueError, match="num_classes"):
        Shapes(10, 32, num_classes=11)


def test_write_shapes_reuses_refuses_and_overwrites(tmp_path):
    root = write_shapes(tmp_path / "s", train_per_class=2, val_per_class=1, image_size=16, num_classes=2)
    meta = json.loads((root / "hpdl_dataset.json").read_text())
    assert meta["num_classes"] == 2 and list(tmp_path.iterdir()) == [root]  # no temporary folder left behind
    train = image_folder(root, "train")
    assert train.classes == list(SHAPE_CLASSES[:2]) and len(train) == 4 and len(image_folder(root, "val")) == 2
    mtime = (root / "hpdl_dataset.json").stat().st_mtime_ns
    write_shapes(root, train_per_class=2, val_per_class=1, image_size=16, num_classes=2)  # same set: reused
    assert (root / "hpdl_dataset.json").stat().st_mtime_ns == mtime
    with pytest.raises(FileExistsError, match="overwrite"):
        write_shapes(root, train_per_class=3, val_per_class=1, image_size=16, num_classes=2)
    write_shapes(root, train_per_class=3, val_per_class=1, image_size=16, num_classes=2, overwrite=True)
    assert len(image_folder(root, "train")) == 6
    with pytest.raises(FileNotFoundError, match="ImageFolder"):
        image_folder(tmp_path, "train")
