"""Classification data: ImageFolder directories (ImageNet layout) and an offline, procedurally drawn shapes set.

    DIR/train/<class>/*.jpg|png     DIR/val/<class>/*.jpg|png     (torchvision ``ImageFolder``, as ImageNet)

``Shapes`` draws 10 classes of shapes (circle, square, triangle, cross, ring, horizontal and vertical stripes,
checkerboard, diamond, star) with random colours, size, position, rotation and pixel noise; image ``i`` of a
seed is always the same picture. ``write_shapes(root)`` saves a train/val split as an ImageFolder, so the
offline default goes through exactly the code path a user's ImageNet folder does; nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SHAPE_CLASSES = ("circle", "square", "triangle", "cross", "ring", "hstripes", "vstripes", "checker", "diamond",
                 "star")
SHAPES_VERSION = 1


def _polygon(cx, cy, r, n, rot, inner=None):
    pts = []
    for k in range(n * (2 if inner else 1)):
        rad = (inner if inner and k % 2 else 1.0) * r
        a = rot + k * math.pi / (n if inner else n / 2)
        pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
    return pts


def draw_shape(kind: str, size: int, rng: np.random.Generator):
    """One ``size x size`` RGB PIL image of shape ``kind`` (one of ``SHAPE_CLASSES``), drawn from ``rng``."""
    from PIL import Image, ImageDraw

    bg = rng.integers(0, 256, 3)
    fg = (bg + 96 + rng.integers(0, 64, 3)) % 256  # at least 96 levels away from the background per channel
    img = Image.new("RGB", (size, size), tuple(int(c) for c in bg))
    d = ImageDraw.Draw(img)
    col = tuple(int(c) for c in fg)
    r = size * rng.uniform(0.2, 0.36)
    cx, cy = rng.uniform(r, size - r, 2)
    rot = rng.uniform(0, 2 * math.pi)
    box = (cx - r, cy - r, cx + r, cy + r)
    if kind == "circle":
        d.ellipse(box, fill=col)
    elif kind == "square":
        d.rectangle(box, fill=col)
    elif kind == "triangle":
        d.polygon(_polygon(cx, cy, r, 3, rot), fill=col)
    elif kind == "cross":
        w = r / 3
        for a in (rot, rot + math.pi / 2):
            dx, dy = math.cos(a), math.sin(a)
            d.line((cx - r * dx, cy - r * dy, cx + r * dx, cy + r * dy), fill=col, width=max(2, int(2 * w)))
    elif kind == "ring":
        d.ellipse(box, outline=col, width=max(2, int(r / 3)))
    elif kind in ("hstripes", "vstripes", "checker"):
        n = int(rng.integers(3, 6))
        step = 2 * r / n
        for i in range(n):
            for j in range(n):
                on = {"hstripes": i % 2 == 0, "vstripes": j % 2 == 0, "checker": (i + j) % 2 == 0}[kind]
                if on:
                    d.rectangle((cx - r + j * step, cy - r + i * step, cx - r + (j + 1) * step,
                                 cy - r + (i + 1) * step), fill=col)
    elif kind == "diamond":
        d.polygon([(cx, cy - r), (cx + 0.7 * r, cy), (cx, cy + r), (cx - 0.7 * r, cy)], fill=col)
    elif kind == "star":
        d.polygon(_polygon(cx, cy, r, 5, rot, inner=0.45), fill=col)
    else:
        raise ValueError(f"kind must be one of {SHAPE_CLASSES}, got {kind!r}")
    noisy = np.asarray(img, dtype=np.float32) + rng.normal(0, 10, (size, size, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


class Shapes(torch.utils.data.Dataset):
    """In-memory procedural classification set: ``num_images`` PIL images (label ``i % num_classes``).

    Args:
        num_images: dataset length.
        image_size: side in pixels.
        num_classes: the first ``num_classes`` of ``SHAPE_CLASSES`` (2..10).
        seed: image i of seed s is always the same picture (independent of worker order).
        transform: applied to the PIL image (e.g. :func:`classification_transforms`).

    Raises:
        ValueError: num_classes outside 2..10, or num_images / image_size < 1 / 8.
    """

    def __init__(self, num_images: int, image_size: int = 64, num_classes: int = 10, seed: int = 0, transform=None):
        if not 2 <= num_classes <= len(SHAPE_CLASSES):
            raise ValueError(f"num_classes must be in 2..{len(SHAPE_CLASSES)}, got {num_classes}")
        if num_images < 1 or image_size < 8:
            raise ValueError(f"num_images must be >= 1 and image_size >= 8, got {num_images} and {image_size}")
        self.num_images, self.image_size, self.seed, self.transform = num_images, image_size, seed, transform
        self.classes = list(SHAPE_CLASSES[:num_classes])

    def __len__(self) -> int:
        return self.num_images

    def __getitem__(self, i: int):
        label = i % len(self.classes)
        img = draw_shape(self.classes[label], self.image_size, np.random.default_rng([self.seed, i]))
        return (self.transform(img) if self.transform else img), label


def default_root() -> Path:
    """Where the offline set lives: ``$HPDL_DATA_DIR/shapes-v1`` (default ``~/.cache/hpdl/data``)."""
    from hpdl.runtime import env

    base = env.get("HPDL_DATA_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hpdl", "data")
    return Path(base) / f"shapes-v{SHAPES_VERSION}"


def write_shapes(root: str | os.PathLike | None = None, train_per_class: int = 300, val_per_class: int = 60,
                 image_size: int = 64, num_classes: int = 10, seed: int = 0, overwrite: bool = False) -> Path:
    """Write the shapes set as ``root/train/<class>/*.png`` and ``root/val/...`` (an ImageFolder) and return root.

    A finished folder holds ``hpdl_dataset.json``; one with the same parameters is reused, anything else in the way
    raises (or is replaced with ``overwrite``). Written to a temporary sibling and renamed, so an interrupted or
    concurrent run never leaves half a dataset. Raises FileExistsError: root exists and is something else.
    """
    root = Path(root) if root is not None else default_root()
    meta = {"dataset": "hpdl-shapes", "version": SHAPES_VERSION, "train_per_class": train_per_class,
            "val_per_class": val_per_class, "image_size": image_size, "num_classes": num_classes, "seed": seed}
    marker = root / "hpdl_dataset.json"
    if root.exists():
        if marker.exists() and json.loads(marker.read_text()) == meta:
            return root
        if not overwrite:
            raise FileExistsError(f"{root} exists and is not this shapes set ({meta}); pass overwrite=True "
                                  f"(--overwrite) or another folder")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    try:
        for split, per_class, split_seed in (("train", train_per_class, seed), ("val", val_per_class, seed + 1)):
            ds = Shapes(per_class * num_classes, image_size, num_classes, seed=split_seed)
            for name in ds.classes:
                (tmp / split / name).mkdir(parents=True)
            for i in range(len(ds)):
                img, label = ds[i]
                img.save(tmp / split / ds.classes[label] / f"{i:06d}.png")
        (tmp / "hpdl_dataset.json").write_text(json.dumps(meta, indent=1))
        if root.exists():
            shutil.rmtree(root)
        try:
            tmp.rename(root)
        except OSError:  # another process finished first: keep its copy if it is the same set
            if not (marker.exists() and json.loads(marker.read_text()) == meta):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def classification_transforms(image_size: int, train: bool, augment: str = "basic"):
    """torchvision transforms to a normalised ``[3, image_size, image_size]`` float tensor.

    ``train`` with ``augment="basic"``: RandomResizedCrop(scale 0.25-1) + horizontal flip; ``"deit"``: timm's DeiT
    recipe (RandAugment rand-m9-mstd0.5-inc1, random erasing 0.25, bicubic), which the official SOFT training
    used. Evaluation: resize to image_size/0.875, centre crop. ImageNet mean/std normalisation throughout.
    """
    from torchvision import transforms as T

    if augment not in ("basic", "deit"):
        raise ValueError(f"augment must be 'basic' or 'deit', got {augment!r}")
    if train and augment == "deit":
        from timm.data import create_transform

        return create_transform(image_size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                interpolation="bicubic", re_prob=0.25, re_mode="pixel", re_count=1)
    norm = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    if train:
        return T.Compose([T.RandomResizedCrop(image_size, scale=(0.25, 1.0)), T.RandomHorizontalFlip(), *norm])
    return T.Compose([T.Resize(int(round(image_size / 0.875))), T.CenterCrop(image_size), *norm])


def image_folder(root: str | os.PathLike, split: str, transform=None):
    """``torchvision.datasets.ImageFolder(root/split)``. Raises FileNotFoundError naming the expected layout."""
    from torchvision.datasets import ImageFolder

    path = Path(root) / split
    if not path.is_dir():
        raise FileNotFoundError(f"--data {root}: expected an ImageFolder split at {path} "
                                f"(DIR/train/<class>/*.jpg and DIR/val/<class>/*.jpg, as ImageNet)")
    return ImageFolder(str(path), transform=transform)
