"""Synthetic instance-segmentation dataset in COCO format: overlapping shapes of several classes, exact masks.

Every image is rendered from its masks (no anti-aliasing), so a mask is exactly the set of pixels its instance
shows: a later shape occludes earlier ones and the earlier masks lose the occluded pixels. A shape whose
placement would leave any instance less than ``min_visible`` of its own area visible is redrawn elsewhere, so
every painted instance is labelled and recognisable. Each image is drawn from its own generator seeded by
``(seed, split, index)``: the set is identical for a seed on any machine, whatever the order of generation.

Layout (the COCO 2017 layout with split names ``train`` and ``val``)::

    root/train/000000.png ...            root/val/000000.png ...
    root/annotations/instances_train.json    root/annotations/instances_val.json

Annotations carry compressed RLE segmentations, ``bbox`` as ``[x, y, w, h]`` of the visible mask, ``area`` as
its pixel count and ``iscrowd`` 0; categories are numbered from 1.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

CLASSES = ("circle", "triangle", "square")
SPLITS = {"train": 0, "val": 1}


@dataclass(frozen=True)
class ShapesConfig:
    """What ``make_shapes`` draws. Sizes are fractions of the image side; ``num_*`` count images."""

    num_train: int = 1000
    num_val: int = 100
    image_size: int = 128
    classes: tuple[str, ...] = CLASSES
    min_instances: int = 1
    max_instances: int = 5
    min_scale: float = 0.15       # shape's circumscribed diameter, as a fraction of the image side
    max_scale: float = 0.45
    min_visible: float = 0.5      # smallest visible fraction of an instance's own area
    seed: int = 0

    def __post_init__(self):
        for name in ("num_train", "num_val"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.image_size < 16:
            raise ValueError(f"image_size must be >= 16 pixels, got {self.image_size}")
        unknown = [c for c in self.classes if c not in CLASSES]
        if unknown or not self.classes:
            raise ValueError(f"classes must be a non-empty subset of {CLASSES}, got {self.classes}")
        if not 1 <= self.min_instances <= self.max_instances:
            raise ValueError(f"need 1 <= min_instances <= max_instances, got {self.min_instances}, "
                             f"{self.max_instances}")
        if not 0 < self.min_scale <= self.max_scale <= 1:
            raise ValueError(f"need 0 < min_scale <= max_scale <= 1, got {self.min_scale}, {self.max_scale}")
        if not 0 < self.min_visible <= 1:
            raise ValueError(f"min_visible must be in (0, 1], got {self.min_visible}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def _shape_mask(kind: str, cx: float, cy: float, radius: float, angle: float, size: int) -> np.ndarray:
    """bool [size, size]: pixels whose centre lies inside the shape (circumradius ``radius``, rotated)."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    if kind == "circle":
        return (xs - cx) ** 2 + (ys - cy) ** 2 <= radius**2
    n = 3 if kind == "triangle" else 4
    t = angle + 2 * math.pi * np.arange(n) / n
    vx, vy = cx + radius * np.cos(t), cy + radius * np.sin(t)   # counter-clockwise in (x, y)
    inside = np.ones((size, size), dtype=bool)
    for i in range(n):  # left of every edge of a convex counter-clockwise polygon
        ex, ey = vx[(i + 1) % n] - vx[i], vy[(i + 1) % n] - vy[i]
        inside &= ex * (ys - vy[i]) - ey * (xs - vx[i]) >= 0
    return inside


def _color(rng: np.random.Generator, avoid: np.ndarray, min_dist: float = 90.0) -> np.ndarray:
    for _ in range(100):
        c = rng.integers(0, 256, 3)
        if np.linalg.norm(c - avoid) >= min_dist:
            return c
    return 255 - avoid


def render_image(cfg: ShapesConfig, split: str, index: int) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """One image and its instances, deterministic in ``(cfg.seed, split, index)``.

    Returns:
        ``(image, instances)``: image uint8 [S, S, 3]; instances a list of ``(class_index, mask)`` with
        ``class_index`` into ``cfg.classes`` and ``mask`` bool [S, S], the visible pixels, in drawing order.
    """
    s = cfg.image_size
    rng = np.random.default_rng([cfg.seed, SPLITS[split], index])
    background = rng.integers(0, 256, 3)
    # smooth brightness ramp plus pixel noise, so that "not background" is not a single colour test
    ramp = np.linspace(-25, 25, s)[None, :, None] * rng.choice([-1, 1])
    image = np.clip(background + ramp + rng.normal(0, 8, (s, s, 3)), 0, 255)
    want = int(rng.integers(cfg.min_instances, cfg.max_instances + 1))
    instances: list[list] = []   # [class_index, full_mask, visible_mask]
    for _ in range(want):
        for _attempt in range(20):
            kind = int(rng.integers(len(cfg.classes)))
            radius = rng.uniform(cfg.min_scale, cfg.max_scale) * s / 2
            cx, cy = rng.uniform(radius * 0.6, s - radius * 0.6, 2)
            full = _shape_mask(cfg.classes[kind], cx, cy, radius, rng.uniform(0, 2 * math.pi), s)
            if full.sum() < 16:
                continue
            if all((inst[2] & ~full).sum() >= cfg.min_visible * inst[1].sum() for inst in instances):
                for inst in instances:
                    inst[2] = inst[2] & ~full
                instances.append([kind, full, full.copy()])
                break
    for kind, full, _ in instances:
        avoid = image[full].mean(0) if full.any() else background
        color = _color(rng, avoid)
        image[full] = np.clip(color + rng.normal(0, 6, (int(full.sum()), 3)), 0, 255)
    return image.astype(np.uint8), [(kind, vis) for kind, _, vis in instances]


def _annotation(mask: np.ndarray, category_id: int) -> dict:
    from pycocotools import mask as mask_utils

    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    ys, xs = np.nonzero(mask)
    x0, y0 = int(xs.min()), int(ys.min())
    return {"category_id": category_id, "iscrowd": 0, "area": int(mask.sum()),
            "bbox": [x0, y0, int(xs.max()) + 1 - x0, int(ys.max()) + 1 - y0],
            "segmentation": {"size": list(rle["size"]), "counts": rle["counts"].decode("ascii")}}


def _write_images(cfg: ShapesConfig, split: str, indices: range, folder: str) -> list[list[dict]]:
    """Render and save ``indices`` of ``split``; returns each image's annotations (without ids)."""
    from PIL import Image

    out = []
    for i in indices:
        image, instances = render_image(cfg, split, i)
        Image.fromarray(image).save(Path(folder) / f"{i:06d}.png", compress_level=1)
        out.append([_annotation(mask, kind + 1) for kind, mask in instances])
    return out


def _config_json(cfg: ShapesConfig) -> dict:
    return {**asdict(cfg), "classes": list(cfg.classes)}


def _in_the_way(root: Path, cfg: ShapesConfig) -> str | None:
    """Why writing ``cfg``'s set into ``root`` would destroy something, or None (nothing there, or this set)."""
    for split in SPLITS:
        ann = root / "annotations" / f"instances_{split}.json"
        if ann.is_file():
            try:
                config = json.loads(ann.read_text()).get("info", {}).get("config")
            except (OSError, ValueError, AttributeError):
                config = None
            if config != _config_json(cfg):
                return f"{ann} is not this shapes set ({'config ' + str(config) if config else 'another dataset'})"
    if not any((root / "annotations" / f"instances_{split}.json").is_file() for split in SPLITS):
        for split in SPLITS:
            if (root / split).is_dir() and any((root / split).iterdir()):
                return f"{root / split} holds files and no shapes annotations"
    return None


def make_shapes(root: str | Path, cfg: ShapesConfig = ShapesConfig(), *, workers: int = 0,
                overwrite: bool = False, progress=None) -> dict[str, Path]:
    """Write the shapes dataset of ``cfg`` under ``root`` (see the module docstring for the layout).

    Args:
        root: output folder. The same set there (same ``cfg``) is written again; anything else in the way
            (another config's set, images without annotations) raises unless ``overwrite``, which replaces
            the set: its annotation files are rewritten and images of the old set not in the new one removed.
        cfg: what to draw.
        workers: processes that render in parallel (0: in this process). The output does not depend on it.
        overwrite: replace a different set in ``root``.
        progress: optional ``callable(done, total)`` called as images are written.

    Returns:
        ``{split: annotation file}`` for ``train`` and ``val``.
    Raises:
        HpdlError: ``root`` holds something else (and not ``overwrite``), or cannot be created.
        ValueError: ``workers`` < 0.
    """
    from hpdl.runtime.errors import HpdlError

    if workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    root = Path(root)
    reason = _in_the_way(root, cfg) if root.is_dir() else None
    if reason and not overwrite:
        raise HpdlError(f"root={str(root)!r}: {reason}; pass overwrite=True (--overwrite) or another folder")
    try:
        (root / "annotations").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HpdlError(f"root={str(root)!r} cannot be created ({exc.strerror or exc})") from None
    for split, count in (("train", cfg.num_train), ("val", cfg.num_val)):   # the old set's extra images
        if reason and (root / split).is_dir():
            for f in (root / split).glob("[0-9][0-9][0-9][0-9][0-9][0-9].png"):
                if int(f.stem) >= count:
                    f.unlink()
    categories = [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(cfg.classes)]
    total, done, files = cfg.num_train + cfg.num_val, 0, {}
    pool = None
    if workers > 0:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
    try:
        for split, count in (("train", cfg.num_train), ("val", cfg.num_val)):
            (root / split).mkdir(exist_ok=True)
            chunk = 16 if pool is None else max(1, min(64, -(-count // (4 * workers))))
            parts = [range(a, min(a + chunk, count)) for a in range(0, count, chunk)]
            if pool is None:
                results = (_write_images(cfg, split, r, str(root / split)) for r in parts)
            else:
                results = pool.map(_write_images, [cfg] * len(parts), [split] * len(parts), parts,
                                   [str(root / split)] * len(parts))
            images, annotations = [], []
            for r, anns_per_image in zip(parts, results):
                for i, anns in zip(r, anns_per_image):
                    images.append({"id": i + 1, "file_name": f"{i:06d}.png", "height": cfg.image_size,
                                   "width": cfg.image_size})
                    annotations += [{"id": len(annotations) + k + 1, "image_id": i + 1, **a}
                                    for k, a in enumerate(anns)]
                done += len(r)
                if progress is not None:
                    progress(done, total)
            files[split] = root / "annotations" / f"instances_{split}.json"
            info = {"description": "hpdl synthetic shapes", "generator": "hpdl.vision.shapes",
                    "config": _config_json(cfg)}
            files[split].write_text(json.dumps({"info": info, "images": images, "annotations": annotations,
                                                "categories": categories}))
    finally:
        if pool is not None:
            pool.shutdown()
    return files
