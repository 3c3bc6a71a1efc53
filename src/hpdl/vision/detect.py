"""Instance segmentation and detection: SPRNet and its anchors (torchvision's Mask R-CNN and RetinaNet), trained
and evaluated the same way on any COCO-format dataset (default: the offline shapes set).

    hpdl vision make-shapes --root shapes --train 1000 --val 100
    hpdl vision train --model sprnet --data shapes --epochs 12
    hpdl vision evaluate --model sprnet --checkpoint vision_out/sprnet.pt

The task module of ``hpdl vision`` (contract in :mod:`hpdl.vision.cli`). The Python API under it:
:func:`build_model`, :func:`fit` (AdamW, linear warm-up then cosine, bf16 autocast on CUDA, gradient
clipping), :func:`predict`, :func:`evaluate_model` (pycocotools box and mask AP), :func:`draw_predictions`.
All three models share one backbone builder (ResNet-FPN, nothing downloaded), anchor sizes and input size.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hpdl.runtime.errors import HpdlError
from hpdl.runtime.limits import count
from hpdl.runtime.options import Options, option
from hpdl.vision.options import EvaluateRun, TrainRun
from hpdl.vision.shapes import ShapesConfig

MODELS = ("sprnet", "maskrcnn", "retinanet")
MIN_IMAGE_SIZE = 32   # the pyramid's P7 is 1/128 of the input: below 32 px a 1x1 batch-norm input fails in training
MASK_MODELS = ("sprnet", "maskrcnn")
DEFAULTS = {"image_size": 256, "batch_size": 8, "epochs": 12, "lr": 5e-4, "weight_decay": 1e-4,
            "warmup_steps": 100, "clip": 10.0}
SHAPES_DEFAULT = {"num_train": 1000, "num_val": 100, "image_size": 128}


# ---------------------------------------------------------------- models

def default_anchor_sizes(image_size: int) -> tuple[int, ...]:
    """Base anchor sizes of the five pyramid levels for inputs of ``image_size`` pixels.

    COCO's (32 ... 512) from 256 pixels up; below, shrunk with the input (base ``image_size / 8``, at least
    8), so that the smallest anchor stays near the smallest objects of a downscaled set.
    """
    base = min(32, max(8, image_size // 8))
    return tuple(base * 2**i for i in range(5))


def build_model(name: str, num_classes: int, *, backbone: str = "resnet50", image_size: int = 800,
                fpn_channels: int = 256, backbone_weights: str | None = None, anchor_sizes=None,
                fpn: str = "gated", paste: str = "auto", **sprnet_overrides) -> torch.nn.Module:
    """One of ``MODELS`` on a ResNet-FPN, for inputs resized to ``image_size`` (shorter side).

    Args:
        name: ``sprnet``, ``maskrcnn`` (torchvision MaskRCNN, P2-P6) or ``retinanet`` (torchvision RetinaNet).
        num_classes: including background; labels are 1..num_classes-1.
        backbone: a torchvision ResNet name (``resnet18`` keeps CPU runs small; the paper's is ``resnet50``).
        image_size: the transform's ``min_size``; ``max_size`` is ``image_size * 1333 / 800``.
        backbone_weights: local ResNet state dict; otherwise random init (nothing is downloaded).
        anchor_sizes: base anchor sizes of the five levels (default :func:`default_anchor_sizes`).
        fpn: SPRNet's pyramid, ``gated`` (GFPN) or ``sum``; the anchors always use torchvision's FPN.
        paste: ``batched`` (:func:`hpdl.models.sprnet.paste_masks`) or ``torchvision`` (its per-mask loop);
            ``auto``: SPRNet batched, Mask R-CNN torchvision's (its masks follow torchvision's convention).
        sprnet_overrides: further :class:`hpdl.models.sprnet.SPRNetConfig` fields.
    """
    from torchvision.models.detection import MaskRCNN, RetinaNet
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
    from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    from hpdl.models.sprnet import PastingTransform, SPRNet, SPRNetConfig, resnet_fpn, retina_anchors

    if name not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    if paste not in ("auto", "batched", "torchvision"):
        raise ValueError(f"paste must be 'auto', 'batched' or 'torchvision', got {paste!r}")
    if sprnet_overrides and name != "sprnet":
        raise ValueError(f"{sorted(sprnet_overrides)} are SPRNet settings, not {name}'s")
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be >= {MIN_IMAGE_SIZE} pixels for the detection models, got {image_size}")
    sizes = tuple(anchor_sizes or default_anchor_sizes(image_size))
    min_size, max_size = image_size, int(round(image_size * 1333 / 800))
    common = {"min_size": min_size, "max_size": max_size, "detections_per_img": 100}
    c = fpn_channels
    if name == "sprnet":
        cfg = SPRNetConfig(num_classes=num_classes, backbone=backbone, backbone_weights=backbone_weights,
                           fpn=fpn, fpn_channels=c, anchor_sizes=sizes, min_size=min_size, max_size=max_size,
                           **sprnet_overrides)
        model = SPRNet(cfg)
    elif name == "retinanet":
        body = resnet_fpn(backbone, out_channels=c, returned_layers=(2, 3, 4), extra_blocks=LastLevelP6P7(c, c),
                          weights_path=backbone_weights)
        model = RetinaNet(body, num_classes, anchor_generator=retina_anchors(sizes), **common)
    else:
        body = resnet_fpn(backbone, out_channels=c, returned_layers=(1, 2, 3, 4), weights_path=backbone_weights)
        rpn_anchors = AnchorGenerator(tuple((s,) for s in sizes), ((0.5, 1.0, 2.0),) * len(sizes))
        # torchvision's mask head is 4 convs + a deconvolution of 256 channels whatever the FPN width: make it
        # the FPN's width (identical to torchvision's default at 256)
        model = MaskRCNN(body, None, rpn_anchor_generator=rpn_anchors, min_size=min_size, max_size=max_size,
                         box_detections_per_img=100, box_predictor=FastRCNNPredictor(1024, num_classes),
                         mask_head=MaskRCNNHeads(c, (c,) * 4, 1), mask_predictor=MaskRCNNPredictor(c, c, num_classes))
    if paste == "batched" and name != "sprnet":
        t = model.transform
        model.transform = PastingTransform(t.min_size, t.max_size, t.image_mean, t.image_std)
    elif paste == "torchvision" and name == "sprnet":
        from torchvision.models.detection.transform import GeneralizedRCNNTransform

        if model.config.mask_margin != 1.0:
            raise ValueError(f"paste='torchvision' pastes into the box itself, but SPRNet's masks live in a frame "
                             f"mask_margin={model.config.mask_margin} times it: use paste='batched' (or "
                             "mask_margin=1.0)")
        t = model.transform
        model.transform = GeneralizedRCNNTransform(t.min_size, t.max_size, t.image_mean, t.image_std)
    model.hpdl_spec = {"name": name, "num_classes": num_classes, "backbone": backbone, "image_size": image_size,
                       "fpn_channels": c, "anchor_sizes": list(sizes), "fpn": fpn, "paste": paste,
                       **sprnet_overrides}
    return model


def save_checkpoint(path: str | Path, model: torch.nn.Module, meta: dict) -> None:
    """Write the model's weights, its :func:`build_model` arguments and ``meta`` (categories, data, ...).

    Written to a temporary file and renamed, so a run killed while saving leaves the previous file (or none),
    never a truncated one."""
    spec = {k: (list(v) if isinstance(v, tuple) else v) for k, v in model.hpdl_spec.items()}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save({"format": "hpdl.vision.detect/1", "spec": spec, "meta": meta,
                    "state_dict": model.state_dict()}, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: str | Path, map_location="cpu") -> tuple[torch.nn.Module, dict]:
    """``(model, meta)`` from :func:`save_checkpoint`'s file (keys and shapes checked: a strict load).

    Raises:
        HpdlError: the file is missing, unreadable (truncated) or was not written by :func:`save_checkpoint`.
    """
    if not Path(path).is_file():
        raise HpdlError(f"checkpoint={str(path)!r}: no such file")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as exc:   # truncated or foreign
        raise HpdlError(f"checkpoint={str(path)!r} cannot be read ({str(exc).splitlines()[0][:120]}); write it "
                        "again with `hpdl vision train`") from exc
    if isinstance(ckpt, dict) and "config" in ckpt and isinstance(ckpt.get("model"), str):
        # a classification checkpoint of `hpdl vision train` (SOFT): name what it holds
        raise HpdlError(f"checkpoint={str(path)!r} holds a {ckpt['model']!r} classification model, not a "
                        f"detector: evaluate it with --model {ckpt['model']}")
    if not isinstance(ckpt, dict) or ckpt.get("format") != "hpdl.vision.detect/1" or \
            not {"spec", "state_dict", "meta"} <= ckpt.keys():
        raise HpdlError(f"checkpoint={str(path)!r} is not an hpdl vision detection checkpoint")
    spec = dict(ckpt["spec"])
    spec["backbone_weights"] = None   # the weights come from the checkpoint
    model = build_model(spec.pop("name"), spec.pop("num_classes"), **spec)
    try:
        model.load_state_dict(ckpt["state_dict"])
    except RuntimeError as exc:   # weights edited or written by another build of the model
        raise HpdlError(f"checkpoint={str(path)!r}: its weights do not fit the model its spec describes "
                        f"({' '.join(str(exc).split())[:240]})") from None
    return model, ckpt["meta"]


# ---------------------------------------------------------------- loops

def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` (CUDA when available), or a torch device string.

    Raises:
        HpdlError: CUDA asked for but absent, or a string torch does not parse as a device.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise HpdlError(f"device={device!r} but CUDA is not available here")
    try:
        return torch.device(device)
    except RuntimeError:
        raise HpdlError(f"device={device!r} is not a device: expected auto, cpu, cuda or cuda:N") from None


def _autocast(device: torch.device, amp: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp)


def _Progress(total: int, label: str, enabled: bool = True):
    """Progress of ``total`` steps on stderr (:class:`hpdl.bench.common.Progress`): a rich bar on a terminal,
    about 20 plain lines a run otherwise; ``update(done, text)`` and ``close()``."""
    from hpdl.bench.common import Progress

    return _Labelled(Progress(total, label, enabled=enabled, lines=20), label)


class _Labelled:
    def __init__(self, progress, label: str):
        self._p, self._label = progress, label

    def update(self, done: int, text: str = "") -> None:
        self._p.update(done, f"{self._label} {text} ({self._p.elapsed:.0f} s)")

    def resize(self, total: int) -> None:
        self._p.resize(total)

    def close(self) -> None:
        self._p.close()


def _to(targets: list[dict], device) -> list[dict]:
    return [{k: v.to(device, non_blocking=True) for k, v in t.items()} for t in targets]


def _batches(loader):
    while True:          # cycle over epochs
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:        # cycling an empty loader would spin forever
            raise HpdlError("the training loader yields no batch: an empty dataset, or fewer samples than "
                            "batch_size with drop_last")


class Trainer:
    """:func:`fit` one optimizer step at a time, so that several models can train in lock-step (the device
    benchmark gives every model the same number of steps whatever its speed).

    AdamW over the trainable parameters; the learning rate rises linearly over ``warmup_steps`` times a cosine
    decay to 0 at ``steps``. ``steps`` may be changed between steps (:meth:`set_steps`): the cosine then ends at
    the new count (the benchmark re-plans once, when the warm-up ends, from the measured step times). Arguments
    as :func:`fit`.
    """

    def __init__(self, model: torch.nn.Module, loader, *, steps: int, lr: float = DEFAULTS["lr"],
                 weight_decay: float = DEFAULTS["weight_decay"], warmup_steps: int = DEFAULTS["warmup_steps"],
                 clip: float = DEFAULTS["clip"], device: str | torch.device = "auto", amp: bool | None = None,
                 progress: bool = True, label: str = "train"):
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.amp = self.device.type == "cuda" if amp is None else amp
        self.model, self.lr, self.clip, self.label = model.to(self.device).train(), lr, clip, label
        self.params = [p for p in model.parameters() if p.requires_grad]
        fused = self.device.type == "cuda"
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, fused=fused,
                                     foreach=None if fused else True)
        # the warm-up is never shortened to fit a short run: it was cut to steps // 4 (5 steps of a 20-step smoke
        # test), and the full learning rate after 5 Adam steps on a from-scratch network spiked the loss. A run
        # shorter than warmup_steps ends before the peak
        warm = max(1, warmup_steps)
        self.steps = steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
            1 + math.cos(math.pi * min(1.0, s / max(1, self.steps)))))
        self.bar = _Progress(steps, label, progress)
        self.history, self.curves, self.skipped, self.bad_run, self.step_count = [], {}, 0, 0, 0
        self.batches = _batches(loader)
        self.t0 = time.monotonic()

    @property
    def done(self) -> bool:
        return self.step_count >= self.steps

    def set_steps(self, steps: int) -> None:
        """End the schedule (the cosine, and :attr:`done`) at ``steps`` instead (>= the steps taken)."""
        self.steps = max(steps, self.step_count)
        self.bar.resize(self.steps)

    def step(self, batch: tuple[list, list] | None = None) -> float:
        """One optimizer step (batches whose loss is not finite are skipped, up to 20 in a row): the loss.

        ``batch``: ``(images, targets)`` to train on first (models in lock-step share each batch); the loader
        gives the next one when it is not given, or its loss was not finite."""
        while True:
            images, targets = batch if batch is not None else next(self.batches)
            batch = None
            images = [im.to(self.device, non_blocking=True) for im in images]
            targets = _to(targets, self.device)
            with _autocast(self.device, self.amp):
                losses = self.model(images, targets)
            loss = sum(v.float() for v in losses.values())
            if torch.isfinite(loss):
                break
            self.skipped, self.bad_run = self.skipped + 1, self.bad_run + 1
            self.opt.zero_grad(set_to_none=True)
            if self.bad_run >= 20:
                raise HpdlError(f"{self.label}: 20 consecutive non-finite losses at step {self.step_count}; "
                                f"lower lr={self.lr}")
        self.bad_run = 0
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip > 0:  # 0 turns clipping off (`--clip-grad 0`)
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.sched.step()
        self.step_count += 1
        value = float(loss.detach())
        self.history.append(value)
        for k, v in losses.items():
            self.curves.setdefault(k, []).append(float(v.detach()))
        self.bar.update(self.step_count, f"loss {value:.3f}")
        return value

    def result(self, stopped_early: bool = False) -> dict:
        """The summary :func:`fit` returns (closes the progress bar)."""
        self.bar.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tail = max(1, self.step_count // 10)
        return {"steps": self.step_count, "seconds": time.monotonic() - self.t0, "skipped": self.skipped,
                "stopped_early": stopped_early,
                "losses": {k: sum(v[-tail:]) / len(v[-tail:]) for k, v in self.curves.items()},
                "history": self.history, "curves": self.curves}


def fit(model: torch.nn.Module, loader, *, steps: int, lr: float = DEFAULTS["lr"],
        weight_decay: float = DEFAULTS["weight_decay"], warmup_steps: int = DEFAULTS["warmup_steps"],
        clip: float = DEFAULTS["clip"], device: str | torch.device = "auto", amp: bool | None = None,
        deadline: float | None = None, progress: bool = True, label: str = "train") -> dict:
    """Train a torchvision-style detection model for ``steps`` optimizer steps (a :class:`Trainer`).

    AdamW over the trainable parameters; the learning rate rises linearly over ``warmup_steps`` (never
    shortened: a shorter run ends before the peak) times a cosine decay to 0 at ``steps``; gradients are clipped
    to norm ``clip``; the forward runs under bf16 autocast when ``amp`` (default: on for CUDA). A step whose
    loss is not finite is skipped.

    Args:
        loader: yields ``(images, targets)`` (lists, as :func:`hpdl.vision.coco.collate`); cycled as needed.
        deadline: ``time.monotonic()`` value after which training stops early (the result says so).
    Returns:
        ``{"steps", "seconds", "losses" (mean of each loss over the last 10% of the steps taken), "skipped",
        "stopped_early", "history" (per-step total loss), "curves" (per-step value of each loss)}``.
    Raises:
        HpdlError: 20 consecutive non-finite losses; a loader that yields no batch.
    """
    trainer = Trainer(model, loader, steps=steps, lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps,
                      clip=clip, device=device, amp=amp, progress=progress, label=label)
    stopped = False
    while not trainer.done:
        if deadline is not None and time.monotonic() > deadline:
            stopped = True
            break
        trainer.step()
    return trainer.result(stopped)


@torch.no_grad()
def predict(model: torch.nn.Module, dataset, *, batch_size: int = 8, device: str | torch.device = "auto",
            amp: bool | None = None, workers: int = 0, mask_threshold: float = 0.5,
            progress: bool = True) -> list[tuple[int, dict]]:
    """``[(image_id, output)]`` over a dataset of ``(image, target)``; outputs on the CPU, masks as bool
    ``[N, 1, H, W]`` (thresholded on the device, to keep the copy small)."""
    from torch.utils.data import DataLoader

    from hpdl.vision.coco import collate

    device = resolve_device(device) if isinstance(device, str) else device
    amp = device.type == "cuda" if amp is None else amp
    model.to(device).eval()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers, collate_fn=collate)
    bar = _Progress(len(loader), "predict", progress)
    results = []
    for i, (images, targets) in enumerate(loader):
        with _autocast(device, amp):
            outputs = model([im.to(device, non_blocking=True) for im in images])
        for out, t in zip(outputs, targets):
            if "masks" in out:
                out["masks"] = out["masks"].float() >= mask_threshold
            results.append((int(t["image_id"]), {k: v.cpu() for k, v in out.items()}))
        bar.update(i + 1)
    bar.close()
    return results


def evaluate_model(model: torch.nn.Module, dataset, **predict_kwargs) -> dict:
    """Box and (for mask models) mask AP of ``model`` on a :class:`~hpdl.vision.coco.CocoInstances` split.

    Returns:
        ``{"bbox": {...}, "segm": {...}}`` as :func:`hpdl.vision.coco.coco_evaluate` (fractions), plus
        ``"predictions"``: the ``[(image_id, output)]`` list of :func:`predict`.
    """
    from hpdl.vision.coco import coco_evaluate, to_coco_results

    preds = predict(model, dataset, **predict_kwargs)
    results = to_coco_results([p for _, p in preds], [i for i, _ in preds], dataset.cat_ids)
    has_masks = any("masks" in p for _, p in preds)
    metrics = coco_evaluate(dataset.coco, results, ("bbox", "segm") if has_masks else ("bbox",),
                            image_ids=dataset.ids)
    metrics["predictions"] = preds
    return metrics


@torch.no_grad()
def throughput(model: torch.nn.Module, images: list[torch.Tensor], *, batch_size: int = 1, warmup: int = 5,
               iters: int = 20, repeats: int = 3, amp: bool | None = None, max_seconds: float | None = None) -> dict:
    """Inference images/s of ``model`` on ``images`` (already on the model's device), end to end: transform,
    network, post-processing and mask pasting, as a user calls it.

    ``warmup`` batches first (cuDNN autotuning, allocator), then ``repeats`` timings of ``iters`` batches,
    each between two device synchronisations. With ``max_seconds``, the first batch's time sets fewer
    warm-up batches and iterations where needed to stay within it (at least 1 of each).
    Returns ``{"images_per_s"}`` (median over repeats) with ``"min"``, ``"max"``, ``"batch_size"``,
    ``"iters"``, ``"repeats"``, ``"detections_per_image"`` (mean, last batch).
    """
    device = images[0].device
    amp = device.type == "cuda" if amp is None else amp
    model.eval()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    batches = [images[i:i + batch_size] for i in range(0, len(images) - batch_size + 1, batch_size)]
    if not batches:
        raise ValueError(f"need at least batch_size={batch_size} images, got {len(images)}")
    out = None
    with _autocast(device, amp):
        sync()
        t0 = time.perf_counter()
        model(batches[0])
        sync()
        if max_seconds is not None:   # the first call is the slowest: a safe estimate
            per = time.perf_counter() - t0
            warmup = max(1, min(warmup, int(0.2 * max_seconds / per)))
            iters = max(1, min(iters, int(0.8 * max_seconds / (per * repeats)) - 1))
        for i in range(1, warmup):
            model(batches[i % len(batches)])
        rates = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            for i in range(iters):
                out = model(batches[i % len(batches)])
            sync()
            rates.append(iters * batch_size / (time.perf_counter() - t0))
    rates.sort()
    return {"images_per_s": rates[len(rates) // 2], "min": rates[0], "max": rates[-1], "batch_size": batch_size,
            "iters": iters, "repeats": repeats, "detections_per_image": sum(len(o["boxes"]) for o in out) / len(out)}


def draw_predictions(dataset, predictions: list[tuple[int, dict]], path: str | Path, *, num_images: int = 8,
                     score_thresh: float = 0.5, title: str = "") -> Path:
    """PNG of the first ``num_images`` images with the predicted masks (coloured, 50% alpha), boxes and labels
    whose score is at least ``score_thresh``; the ground truth's outline beside each for comparison.

    Raises:
        ValueError: ``num_images`` < 1 or an empty dataset (nothing to draw).
    """
    from hpdl.bench.common import pyplot

    plt = pyplot()
    import numpy as np

    if num_images < 1 or len(dataset) == 0:
        raise ValueError(f"num_images must be >= 1 and the dataset non-empty, got num_images={num_images}, "
                         f"{len(dataset)} images")
    by_id = dict(predictions)
    n = min(num_images, len(dataset))
    cols = min(4, n)
    rows = max(1, -(-n // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    colors = plt.get_cmap("tab10")
    names = dataset.class_names
    for ax in axes.flat:
        ax.axis("off")
    for k in range(n):
        image, target = dataset[k]
        ax = axes.flat[k]
        out = by_id.get(int(target["image_id"]), {})
        img = image.permute(1, 2, 0).numpy().copy()
        keep = (out["scores"] >= score_thresh).nonzero()[:, 0] if "scores" in out else []
        for j, d in enumerate(keep.tolist() if len(keep) else []):
            c = np.array(colors(j % 10)[:3])
            if "masks" in out:
                m = out["masks"][d, 0].numpy().astype(bool)
                img[m] = 0.5 * img[m] + 0.5 * c
        ax.imshow(img)
        for gm in target["masks"]:
            ax.contour(gm.numpy(), levels=[0.5], colors="white", linewidths=0.6)
        for j, d in enumerate(keep.tolist() if len(keep) else []):
            x0, y0, x1, y1 = out["boxes"][d].tolist()
            c = colors(j % 10)
            ax.add_patch(plt.Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, color=c, linewidth=1))
            ax.text(x0, y0, f"{names[int(out['labels'][d])]} {float(out['scores'][d]):.2f}", color="white",
                    fontsize=6, bbox={"facecolor": c, "alpha": 0.7, "pad": 1, "linewidth": 0})
    fig.suptitle(title or "predictions (fill) and ground truth (white outline)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def format_metrics(rows: dict[str, dict]) -> str:
    """``{model: metrics}`` -> a text table of box and mask AP in points (x 100)."""
    from hpdl.vision.coco import AP_KEYS

    head = f"{'model':<10}" + "".join(f"{'box ' + k:>10}" for k in AP_KEYS[:3]) + \
        "".join(f"{'mask ' + k:>10}" for k in AP_KEYS[:3])
    lines = [head]
    for name, m in rows.items():
        box = "".join(f"{100 * m['bbox'][k]:>10.1f}" for k in AP_KEYS[:3])
        seg = "".join(f"{100 * m['segm'][k]:>10.1f}" if "segm" in m else f"{'-':>10}" for k in AP_KEYS[:3])
        lines.append(f"{name:<10}{box}{seg}")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI (contract: hpdl.vision.cli)

@dataclass(kw_only=True)
class _DetectionOptions(Options):
    val_split: str | None = option(None, help="COCO split to evaluate on (default: val, or the checkpoint's when "
                                              "evaluating)")
    pictures: int = option(8, type=count(0, 10_000),
                           help="images in the predicted-mask picture, 0: no picture (default: 8)")


@dataclass(kw_only=True)
class EvaluateOptions(EvaluateRun, _DetectionOptions):
    """``hpdl vision evaluate`` of a detection model (its architecture comes from the checkpoint)."""


@dataclass(kw_only=True)
class TrainOptions(TrainRun, _DetectionOptions):
    """``hpdl vision train`` of SPRNet, RetinaNet or Mask R-CNN."""

    backbone: str = option("resnet50", choices=("resnet10", "resnet18", "resnet34", "resnet50", "resnet101"),
                           help="detection backbone (default: resnet50, the paper's; resnet18 for quick CPU runs)")
    train_split: str = option("train", help="COCO split to train on (default: train)")
    backbone_weights: str | None = option(None, help="local torchvision ResNet state dict for the detection "
                                                     "backbone (default: random init; nothing is downloaded)")
    fpn: str = option("gated", choices=("gated", "sum"),
                      help="SPRNet pyramid: gated (GFPN, the paper's) or sum (default: gated)")
    fpn_channels: int = option(256, type=count(1, 8192), help="FPN width (default: 256)")


def _shapes_root(out: str, seed: int) -> Path:
    from hpdl.vision.shapes import make_shapes

    root = Path(out) / "shapes"
    if not (root / "annotations" / "instances_val.json").is_file():
        print(f"making the shapes dataset in {root} (`hpdl vision make-shapes` makes others)", file=sys.stderr)
        make_shapes(root, ShapesConfig(**SHAPES_DEFAULT, seed=seed), overwrite=True)   # hpdl's own folder
    return root


def _writable_folder(out: Path) -> Path:
    """Make ``--out`` and prove a file can be written there, before any training time is spent.

    Raises:
        HpdlError: ``out`` is a file, or cannot be created or written (names it and the OS's reason).
    """
    import tempfile

    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise HpdlError(f"--out {str(out)!r} is not a writable folder ({exc.strerror or exc})") from None
    return out


def _print_metrics(name: str, metrics: dict) -> None:
    print(format_metrics({name: metrics}))


def train(options: TrainOptions) -> int:
    """``hpdl vision train --model sprnet|maskrcnn|retinanet``: train, save, evaluate, draw."""
    from torch.utils.data import DataLoader

    from hpdl.vision.coco import CocoInstances, collate

    if options.image_size is not None and options.image_size < MIN_IMAGE_SIZE:   # before any data is made or read
        raise HpdlError(f"--image-size {options.image_size}: detection models need >= {MIN_IMAGE_SIZE} pixels")
    torch.manual_seed(options.seed)
    device = resolve_device(options.device)
    out = _writable_folder(Path(options.out))
    data = Path(options.data) if options.data else _shapes_root(options.out, options.seed)
    amp = device.type == "cuda" if options.amp is None else options.amp
    image_size = options.image_size or DEFAULTS["image_size"]
    batch_size = options.batch_size or DEFAULTS["batch_size"]
    train_ds = CocoInstances(data, options.train_split, train=True)
    if len(train_ds) == 0:
        raise HpdlError(f"data={str(data)!r} split {options.train_split!r} has no image with a non-crowd instance to "
                        "train on")
    val_split = options.val_split or "val"
    val_ds = CocoInstances(data, val_split)
    if len(val_ds) == 0:   # found before training: the evaluation reported AP -100 and no mask AP
        raise HpdlError(f"data={str(data)!r} split {val_split!r} has no image to evaluate on")
    if train_ds.cat_ids != val_ds.cat_ids:
        raise HpdlError(f"splits {options.train_split!r} and {val_split!r} have different categories")
    model = build_model(options.model, train_ds.num_classes, backbone=options.backbone,
                        image_size=image_size, fpn_channels=options.fpn_channels,
                        backbone_weights=options.backbone_weights,
                        fpn=options.fpn)
    loader = DataLoader(train_ds, batch_size=batch_size, shuffle=True, num_workers=options.workers,
                        collate_fn=collate, drop_last=len(train_ds) >= batch_size,
                        persistent_workers=options.workers > 0, pin_memory=device.type == "cuda")
    steps = options.max_steps or (options.epochs or DEFAULTS["epochs"]) * max(1, len(loader))
    wd = options.weight_decay
    clip = options.clip_grad
    warm_epochs = options.warmup_epochs
    stats = fit(model, loader, steps=steps, lr=options.lr or DEFAULTS["lr"], device=device, amp=amp,
                weight_decay=DEFAULTS["weight_decay"] if wd is None else wd,
                clip=DEFAULTS["clip"] if clip is None else clip,
                warmup_steps=(DEFAULTS["warmup_steps"] if warm_epochs is None
                              else int(round(warm_epochs * max(1, len(loader))))),
                label=f"train {options.model}")
    meta = {"categories": train_ds.categories, "data": str(data.resolve()), "val_split": val_split,
            "train": {k: v for k, v in stats.items() if k not in ("history", "curves")}}
    ckpt = out / f"{options.model}.pt"
    save_checkpoint(ckpt, model, meta)
    metrics = evaluate_model(model, val_ds, batch_size=batch_size, device=device, amp=amp, workers=options.workers)
    preds = metrics.pop("predictions")
    (out / f"{options.model}_metrics.json").write_text(json.dumps({"metrics": metrics, **meta}, indent=1))
    picture = out / f"{options.model}_predictions.png"
    print(f"checkpoint {ckpt}; {stats['steps']} steps in {stats['seconds']:.0f} s" +
          (f"; picture {picture}" if options.pictures and len(val_ds) else ""))
    _print_metrics(options.model, metrics)   # before the picture: a failure there must not hide the metrics
    if options.pictures and len(val_ds):
        draw_predictions(val_ds, preds, picture, num_images=options.pictures,
                         title=f"{options.model} on {data.name}/{val_split}")
    return 0


def evaluate(options: EvaluateOptions) -> int:
    """``hpdl vision evaluate --model NAME --checkpoint CKPT``: box and mask AP on the val split, a picture."""
    from hpdl.vision.coco import CocoInstances

    model, meta = load_checkpoint(options.checkpoint)
    if model.hpdl_spec["name"] != options.model:
        raise HpdlError(f"--model {options.model!r} but checkpoint={options.checkpoint!r} holds a "
                        f"{model.hpdl_spec['name']!r} model")
    data = options.data or meta.get("data")
    split = options.val_split or meta.get("val_split") or "val"
    val_ds = CocoInstances(data, split)
    if len(val_ds) == 0:
        raise HpdlError(f"data={data!r} split {split!r} has no image to evaluate on")
    if [c["id"] for c in meta["categories"]] != val_ds.cat_ids:
        raise HpdlError(f"data={data!r} split {split!r} has categories {val_ds.cat_ids}, the checkpoint "
                        f"{[c['id'] for c in meta['categories']]}")
    device = resolve_device(options.device)
    amp = device.type == "cuda" if options.amp is None else options.amp
    metrics = evaluate_model(model, val_ds, batch_size=options.batch_size or DEFAULTS["batch_size"], device=device,
                             amp=amp, workers=options.workers)
    preds = metrics.pop("predictions")
    _print_metrics(options.model, metrics)   # before the picture: a failure there must not hide the metrics
    if options.pictures and len(val_ds):
        picture = Path(options.checkpoint).with_name(f"{options.model}_evaluate.png")
        draw_predictions(val_ds, preds, picture, num_images=options.pictures, title=f"{options.model} on {split}")
        print(f"picture {picture}")
    return 0


_SHAPES = ShapesConfig()


@dataclass(kw_only=True)
class MakeShapesOptions(Options):
    """``hpdl vision make-shapes``: the synthetic COCO-format shapes set (:func:`hpdl.vision.shapes.make_shapes`)."""

    root: str = option(help="output folder (COCO layout: train/, val/, annotations/)")
    train: int = option(_SHAPES.num_train, type=count(0, 1 << 24),
                        help=f"training images (default: {_SHAPES.num_train})")
    val: int = option(_SHAPES.num_val, type=count(0, 1 << 24), help=f"validation images (default: {_SHAPES.num_val})")
    image_size: int = option(_SHAPES.image_size, type=count(16, 8192),
                             help=f"side in pixels, >= 16 (default: {_SHAPES.image_size})")
    max_instances: int = option(_SHAPES.max_instances, type=count(1, 1000),
                                help=f"instances an image, at most (default: {_SHAPES.max_instances})")
    seed: int = option(_SHAPES.seed, type=count(0, 2**32 - 1), help=f"random seed, >= 0 (default: {_SHAPES.seed})")
    workers: int = option(0, type=count(0, 256), help="rendering processes (default: 0, this one)")
    overwrite: bool = option(False, help="replace a different shapes set (or other files) already in --root")


def make_shapes_set(options: MakeShapesOptions) -> int:
    """Render the set with a progress bar and print its files as JSON."""
    from hpdl.vision.shapes import make_shapes

    o = options
    cfg = ShapesConfig(num_train=o.train, num_val=o.val, image_size=o.image_size, max_instances=o.max_instances,
                       seed=o.seed)
    bar = _Progress(cfg.num_train + cfg.num_val, "make-shapes")
    files = make_shapes(o.root, cfg, workers=o.workers, overwrite=o.overwrite,
                        progress=lambda done, total: bar.update(done))
    bar.close()
    print(json.dumps({k: str(v) for k, v in files.items()}))
    return 0


COMMANDS = {"make-shapes": ("write the synthetic COCO-format shapes dataset (overlapping shapes, exact masks)",
                            MakeShapesOptions, make_shapes_set)}

__all__ = ["MODELS", "build_model", "default_anchor_sizes", "draw_predictions", "evaluate_model", "fit",
           "format_metrics", "load_checkpoint", "predict", "save_checkpoint", "throughput"]
