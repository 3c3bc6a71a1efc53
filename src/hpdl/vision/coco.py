"""COCO-format instance segmentation data: a dataset in torchvision's detection format, and COCO AP.

Any dataset laid out as COCO 2017 works (``root/<split>/`` images, ``root/annotations/instances_<split>.json``),
including hpdl's shapes set (:mod:`hpdl.vision.shapes`). Category ids are mapped to contiguous labels
``1..K`` in ascending id order (0 is background, torchvision's convention) and back when results are written.
AP is computed by pycocotools' ``COCOeval`` ("bbox" and "segm"), the reference implementation.
"""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import numpy as np
import torch

from hpdl.runtime.errors import HpdlError

AP_KEYS = ("AP", "AP50", "AP75", "APs", "APm", "APl")   # the first six COCOeval.stats, in this order


def _quiet():
    return contextlib.redirect_stdout(io.StringIO())   # pycocotools prints progress on stdout


def find_split(root: str | Path, split: str) -> tuple[Path, Path]:
    """``(image_folder, annotation_file)`` of ``split`` under a COCO-layout ``root``.

    ``split`` may be a prefix of the folder's name: ``train`` finds ``train2017`` when there is no ``train``.

    Raises:
        HpdlError: no ``annotations/instances_<name>.json`` with an image folder ``<name>`` exists for ``split``.
    """
    root = Path(root)
    for name in (split, f"{split}2017", f"{split}2014"):
        ann = root / "annotations" / f"instances_{name}.json"
        if ann.is_file() and (root / name).is_dir():
            return root / name, ann
    raise HpdlError(f"data={str(root)!r} has no COCO split {split!r}: expected "
                    f"{root}/annotations/instances_{split}.json and the image folder {root}/{split}/ "
                    f"(or the same with 2017)")


def _check_annotations(coco, ann_file: Path) -> None:
    """Reject an annotation file this reader would fail on later, deep inside a loader worker (a KeyError or
    a TypeError) or silently; replace empty polygon lists by empty RLE masks (pycocotools cannot decode them).

    Raises:
        HpdlError: no ``categories``; an image without an int ``id``, ``file_name``, ``height`` or ``width``; an
        annotation without ``image_id`` of a listed image, a listed ``category_id``, a 4-number ``bbox`` or a
        ``segmentation`` (names the file, the annotation's id and the field).
    """
    data = coco.dataset
    if not isinstance(data.get("categories"), list) or not data["categories"]:
        raise HpdlError(f"{ann_file} has no 'categories' list: a COCO instances file names its categories")
    for img in data.get("images", []):
        missing = [k for k in ("id", "file_name", "height", "width") if k not in img]
        if missing:
            raise HpdlError(f"{ann_file}: image {img.get('id', img.get('file_name'))!r} lacks {missing} (COCO's "
                            "image entries carry id, file_name, height and width)")
        if not isinstance(img["id"], int) or isinstance(img["id"], bool):
            raise HpdlError(f"{ann_file}: image id {img['id']!r} ({img['file_name']}) is not an integer, as COCO's are")
    for n, ann in enumerate(data.get("annotations", [])):
        where = f"{ann_file}: annotation {ann.get('id', f'#{n}')}"
        if ann.get("image_id") not in coco.imgs:
            raise HpdlError(f"{where} has image_id {ann.get('image_id')!r}, not an image of the file")
        if ann.get("category_id") not in coco.cats:
            raise HpdlError(f"{where} has category_id {ann.get('category_id')!r}; the categories are "
                            f"{sorted(coco.cats)}")
        bbox = ann.get("bbox")
        if not (isinstance(bbox, (list, tuple)) and len(bbox) == 4 and
                all(isinstance(v, (int, float)) and math.isfinite(v) for v in bbox)):
            raise HpdlError(f"{where} needs 'bbox' as 4 finite numbers [x, y, w, h], got {bbox!r}")
        if "segmentation" not in ann:
            raise HpdlError(f"{where} has no 'segmentation' (polygons or RLE); instance segmentation needs masks")
        if isinstance(ann["segmentation"], list) and not any(len(p) >= 6 for p in ann["segmentation"]):
            from pycocotools import mask as mask_utils

            info = coco.imgs[ann["image_id"]]
            empty = mask_utils.encode(np.zeros((info["height"], info["width"]), dtype=np.uint8, order="F"))
            ann["segmentation"] = {"size": list(empty["size"]), "counts": empty["counts"].decode("ascii")}


class CocoInstances(torch.utils.data.Dataset):
    """Images and instance targets of one COCO split, in torchvision's detection format.

    ``dataset[i]`` is ``(image, target)``: image float32 [3, H, W] in 0-1; target ``boxes`` float32 [N, 4]
    (x1, y1, x2, y2 pixels, from the annotation's ``bbox``), ``labels`` int64 [N] in ``1..K``, ``masks`` uint8 [N, H, W], ``image_id`` int64
    (the COCO image id). Crowd annotations, boxes under a pixel wide and empty masks are left out of the targets (COCOeval still
    uses the crowd regions, from ``self.coco``).

    Args:
        root: dataset folder (COCO layout, see :func:`find_split`).
        split: split name, e.g. ``train`` or ``val2017``.
        train: drop images without instances and flip each sample horizontally with probability 0.5.
        cache: keep decoded samples in memory after the first read (small sets; one copy per loader worker).
        max_images: use only the first images of the split, by image id.
    """

    def __init__(self, root: str | Path, split: str, *, train: bool = False, cache: bool = False,
                 max_images: int | None = None):
        from pycocotools.coco import COCO

        self.image_dir, self.ann_file = find_split(root, split)
        try:
            with _quiet():
                self.coco = COCO(str(self.ann_file))
        except (ValueError, TypeError, KeyError, AssertionError) as exc:   # not JSON, or not COCO's structure
            raise HpdlError(f"{self.ann_file} is not a COCO annotation file ({type(exc).__name__}: "
                            f"{str(exc)[:160]})") from None
        _check_annotations(self.coco, self.ann_file)
        self.cat_ids = sorted(self.coco.getCatIds())
        self.categories = [self.coco.cats[c] for c in self.cat_ids]
        self.label_of = {c: i + 1 for i, c in enumerate(self.cat_ids)}
        ids = sorted(self.coco.getImgIds())
        if train:
            ids = [i for i in ids if any(not a.get("iscrowd", 0) for a in self.coco.imgToAnns.get(i, []))]
        self.ids = ids[:max_images] if max_images is not None else ids
        self.train = train
        self._cache: dict[int, tuple] | None = {} if cache else None

    @property
    def num_classes(self) -> int:
        """Classes including background (torchvision's ``num_classes``)."""
        return len(self.cat_ids) + 1

    @property
    def class_names(self) -> list[str]:
        return ["background"] + [c["name"] for c in self.categories]

    def __len__(self) -> int:
        return len(self.ids)

    def _load(self, index: int) -> tuple[torch.Tensor, dict]:
        from PIL import Image

        image_id = self.ids[index]
        info = self.coco.imgs[image_id]
        with Image.open(self.image_dir / info["file_name"]) as im:
            image = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
        h, w = image.shape[1:]
        if (h, w) != (info["height"], info["width"]):   # its masks would not fit: every instance was dropped
            raise HpdlError(f"{self.image_dir / info['file_name']} is {w}x{h} pixels but {self.ann_file.name} "
                            f"says {info['width']}x{info['height']} (image id {image_id})")
        boxes, labels, masks = [], [], []
        for ann in self.coco.imgToAnns.get(image_id, []):
            if ann.get("iscrowd", 0):
                continue
            x, y, bw, bh = ann["bbox"]
            box = [max(0.0, x), max(0.0, y), min(float(w), x + bw), min(float(h), y + bh)]
            if box[2] - box[0] < 1 or box[3] - box[1] < 1:
                continue
            m = self.coco.annToMask(ann)
            if m.shape != (h, w) or not m.any():
                continue
            boxes.append(box)
            labels.append(self.label_of[ann["category_id"]])
            masks.append(m)
        target = {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                  "labels": torch.tensor(labels, dtype=torch.int64),
                  "masks": torch.from_numpy(np.stack(masks)) if masks else torch.zeros((0, h, w), dtype=torch.uint8),
                  "image_id": torch.tensor(image_id, dtype=torch.int64)}
        return image, target

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict]:
        if self._cache is None:
            image, target = self._load(index)
        else:
            if index not in self._cache:
                self._cache[index] = self._load(index)
            image, target = self._cache[index]
        image = image.float().div_(255)
        if self.train and torch.rand(()) < 0.5:
            image, target = hflip(image, target)
        return image, target


def hflip(image: torch.Tensor, target: dict) -> tuple[torch.Tensor, dict]:
    """Mirror an image [C, H, W] and its target left-right (boxes, masks; other keys unchanged)."""
    w = image.shape[-1]
    boxes = target["boxes"].clone()
    boxes[:, [0, 2]] = w - target["boxes"][:, [2, 0]]
    return image.flip(-1), {**target, "boxes": boxes, "masks": target["masks"].flip(-1)}


def collate(batch):
    """``[(image, target), ...] -> (images, targets)``, lists as torchvision detection models take them."""
    images, targets = zip(*batch)
    return list(images), list(targets)


def to_coco_results(outputs: list[dict], image_ids: list[int], cat_ids: list[int], *,
                    mask_threshold: float = 0.5) -> list[dict]:
    """Detections in torchvision format -> COCO result dicts (``bbox`` x, y, w, h; ``segmentation`` RLE).

    Args:
        outputs: per image ``boxes`` [N, 4] (x1, y1, x2, y2), ``labels`` [N] in ``1..K``, ``scores`` [N], and
            optionally ``masks`` [N, 1, H, W] (probabilities, or bool/uint8 already thresholded). Label 0 is
            background, which RetinaNet-style heads can emit (torchvision's RetinaNet and SPRNet score it like
            any class): it has no COCO category and is left out.
        image_ids: COCO image id of each output.
        cat_ids: COCO category id of label ``k`` at position ``k - 1``.
        mask_threshold: probability at and above which a pixel belongs to the mask.

    Raises:
        ValueError: a label outside ``0..K``.
    """
    from pycocotools import mask as mask_utils

    results = []
    for n, (out, image_id) in enumerate(zip(outputs, image_ids)):
        boxes = out["boxes"].detach().float().cpu().numpy()
        scores = out["scores"].detach().float().cpu().tolist()
        labels = out["labels"].tolist()
        bad = [k for k in labels if not 0 <= k <= len(cat_ids)]
        if bad:
            raise ValueError(f"outputs[{n}] has label {bad[0]}; labels must be 1..{len(cat_ids)} (0: background)")
        cats = [cat_ids[k - 1] if k else None for k in labels]
        rles = None
        if "masks" in out:
            masks = out["masks"].detach()
            if masks.dtype.is_floating_point:
                masks = masks >= mask_threshold
            masks = masks[:, 0].to(torch.uint8).cpu().numpy()
            rles = mask_utils.encode(np.asfortranarray(masks.transpose(1, 2, 0))) if len(masks) else []
        for j in range(len(scores)):
            if cats[j] is None:
                continue
            x0, y0, x1, y1 = boxes[j].tolist()
            r = {"image_id": int(image_id), "category_id": cats[j], "score": scores[j],
                 "bbox": [x0, y0, x1 - x0, y1 - y0]}
            if rles is not None:
                r["segmentation"] = {"size": rles[j]["size"], "counts": rles[j]["counts"].decode("ascii")}
            results.append(r)
    return results


def coco_evaluate(coco_gt, results: list[dict], iou_types=("bbox", "segm"), image_ids=None) -> dict:
    """COCO AP of ``results`` against ``coco_gt`` (a ``pycocotools.coco.COCO``), by pycocotools' COCOeval.

    Returns:
        ``{iou_type: {"AP", "AP50", "AP75", "APs", "APm", "APl"}}`` as fractions in [0, 1] (-1 where the
        split has no object of that size). "segm" is scored without the results' ``bbox`` field, so a mask's
        size bucket is its mask area. Results that are empty, or lack the type's field, are scored as
        no detections (0 where the split has objects; ``loadRes`` itself cannot take an empty list).
    """
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    metrics = {}
    for iou_type in iou_types:
        field = "segmentation" if iou_type == "segm" else "bbox"
        usable = [r for r in results if field in r]
        if iou_type == "segm":
            # without "bbox", loadRes takes a detection's area from its mask: with it, from the box, and the
            # size buckets (APs/APm/APl) would sort unmatched masks by their boxes' area (detectron2 drops it too)
            usable = [{k: v for k, v in r.items() if k != "bbox"} for r in usable]
        with _quiet():
            if usable:
                coco_dt = coco_gt.loadRes([dict(r) for r in usable])   # loadRes adds fields to the dicts it gets
            else:
                coco_dt = COCO()
                coco_dt.dataset = {"images": list(coco_gt.dataset.get("images", [])), "annotations": [],
                                   "categories": list(coco_gt.dataset.get("categories", []))}
                coco_dt.createIndex()
            ev = COCOeval(coco_gt, coco_dt, iou_type)
            if image_ids is not None:
                ev.params.imgIds = list(image_ids)
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
        metrics[iou_type] = {k: float(v) for k, v in zip(AP_KEYS, ev.stats[:6])}
    return metrics
