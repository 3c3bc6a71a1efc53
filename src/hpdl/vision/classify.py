"""Image classification for ``hpdl vision``: train and evaluate SOFT models on an ImageFolder (ImageNet layout).

    hpdl vision make-classes [--out DIR]                                # the offline set (also made on demand)
    hpdl vision train --model soft_tiny [--data DIR] [--epochs N] ...  # DIR/train, DIR/val; default: shapes set
    hpdl vision evaluate --model soft_tiny --checkpoint vision_out/checkpoint.pt [--data DIR]
    torchrun --nproc-per-node 8 -m hpdl.cli vision train --model soft_small --data /imagenet  # data parallel

Recipe (the official SOFT one, DeiT's, where it applies): AdamW, weight decay 0.05 (not on biases, norms,
cls token), linear warm-up then cosine decay per step to ``lr/20``, gradient clipping 1.0, label smoothing 0.1;
``--augment deit`` adds timm's RandAugment, random erasing and Mixup/CutMix. AMP is bf16 autocast on CUDA (fp16
with a gradient scaler on request); SOFT's kernel and Newton-Raphson inverse stay in float32 inside autocast.

Python API: :func:`fit` (any ``nn.Module`` classifier and datasets) and :func:`evaluate_model`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpdl.models.soft import MODEL_CONFIGS, SoftConfig, SoftViT, create
from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.limits import count, real
from hpdl.runtime.options import Options, option
from hpdl.vision.options import EvaluateRun, TrainRun

MODELS = tuple(MODEL_CONFIGS)
OFFLINE_IMAGE_SIZE = 64


@dataclass
class TrainConfig:
    """Options of :func:`fit` (the CLI's defaults in brackets where they differ)."""

    epochs: int = 10
    batch_size: int = 128
    lr: float = 1e-3  # peak, reached after the warm-up
    min_lr_ratio: float = 0.05  # cosine decays to lr * this (official: 1e-3 -> 5e-5)
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    clip_grad: float | None = 1.0
    label_smoothing: float = 0.1
    mixup: bool = False  # timm Mixup/CutMix (0.8/1.0), with --augment deit
    max_steps: int | None = None
    device: str = "auto"
    amp: bool | None = None  # None: on for CUDA
    amp_dtype: str = "bf16"
    workers: int = 2
    seed: int = 0
    out: str | None = None  # checkpoint.pt and metrics.jsonl are written here
    progress: bool | None = None  # None: a bar on a terminal, plain lines otherwise
    log_lines_per_epoch: int = 10


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> cuda (this process's LOCAL_RANK under torchrun, on ``cuda:(LOCAL_RANK // ranks_per_gpu)``
    when ``HPDL_RANKS_PER_GPU`` makes ranks share GPUs) when available, else cpu."""
    from hpdl.runtime.launch import device_for, ranks_per_gpu_of

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible")
        return device_for("cuda", int(os.environ.get("LOCAL_RANK", 0)), ranks_per_gpu_of(None))[0]
    return torch.device(name)


def _dist():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Progress:
    """A rich progress bar on a terminal; plain lines (a few per epoch) when stdout is not one."""

    def __init__(self, enabled: bool | None, lines_per_epoch: int):
        self.tty = sys.stdout.isatty() if enabled is None else enabled
        self.lines = max(1, lines_per_epoch)
        self.bar = None
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self.bar.start()

    def epoch(self, epoch: int, epochs: int, steps: int):
        self.steps, self.label = steps, f"epoch {epoch}/{epochs}"
        if self.bar is not None:
            self.task = self.bar.add_task(self.label, total=steps, info="")

    def wants(self, i: int) -> bool:
        """Whether step i is shown (the loss is read back from the device only then)."""
        every = max(1, self.steps // (100 if self.bar is not None else self.lines))
        return i == self.steps or i % every == 0

    def step(self, i: int, info: str):
        if self.bar is not None:
            self.bar.update(self.task, completed=i, info=info)
        else:
            print(f"{self.label} step {i}/{self.steps} {info}", flush=True)

    def note(self, text: str):
        """A one-off line (e.g. the validation pass after an epoch, minutes on a CPU)."""
        if self.bar is not None:
            self.bar.update(self.task, info=text)
        else:
            print(f"{self.label} {text}", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.stop()


def _param_groups(model: nn.Module, weight_decay: float):
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 to ``min_ratio`` at ``total`` (of the peak lr)."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def _autocast(device: torch.device, cfg: TrainConfig):
    on = cfg.amp if cfg.amp is not None else device.type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.amp_dtype]
    return torch.autocast(device.type, dtype=dtype, enabled=bool(on)), bool(on) and dtype == torch.float16


def _loader(dataset, batch_size, shuffle, workers, device, sampler=None, drop_last=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle and sampler is None,
                                       sampler=sampler, num_workers=workers, pin_memory=device.type == "cuda",
                                       drop_last=drop_last, persistent_workers=workers > 0, generator=g)


@torch.no_grad()
def evaluate_model(model: nn.Module, dataset, *, batch_size: int = 128, device: str | torch.device = "auto",
                   amp: bool | None = None, amp_dtype: str = "bf16", workers: int = 2) -> dict:
    """Top-1/top-5 accuracy (%) and mean cross-entropy of ``model`` on ``dataset`` (image tensor, label pairs).

    Under torch.distributed each rank takes every world-th sample and the sums are all-reduced, so the counts are
    exact. Returns ``{"loss", "top1", "top5", "images", "images_per_s"}``.
    """
    device = resolve_device(device) if isinstance(device, str) else device
    rank, world = _dist()
    shard = torch.utils.data.Subset(dataset, range(rank, len(dataset), world)) if world > 1 else dataset
    ctx, _ = _autocast(device, TrainConfig(amp=amp, amp_dtype=amp_dtype))
    was = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top1, top5, count
    t0 = time.perf_counter()
    for x, y in _loader(shard, batch_size, False, workers, device):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with ctx:
            logits = model(x)
        logits = logits.float()
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        sums += torch.stack([F.cross_entropy(logits, y, reduction="sum"), (top[:, 0] == y).sum(),
                             (top == y[:, None]).any(1).sum(), torch.tensor(y.numel(), device=device)]).double()
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(sums)
    model.train(was)
    loss, c1, c5, n = sums.tolist()
    n = max(n, 1)
    return {"loss": loss / n, "top1": 100 * c1 / n, "top5": 100 * c5 / n, "images": int(n),
            "images_per_s": n / (time.perf_counter() - t0)}


def fit(model: nn.Module, train_set, val_set=None, cfg: TrainConfig | None = None, on_epoch=None) -> dict:
    """Train ``model`` (logits ``[B, classes]``) on ``train_set``; evaluate on ``val_set`` after every epoch.

    Data parallel when torch.distributed is initialised (DistributedSampler, DDP; rank 0 logs). ``on_epoch(record)``
    is called on rank 0 after each epoch (the CLI saves its checkpoint there); with ``cfg.out`` set, each epoch's
    record is appended to ``cfg.out/metrics.jsonl``.

    Returns ``{"history": [per-epoch dicts], "steps": int, "final": last val metrics or None}``.
    Raises ValueError: an empty training set or a batch size larger than it.
    """
    cfg = cfg or TrainConfig()
    device = resolve_device(cfg.device)
    rank, world = _dist()
    if len(train_set) < cfg.batch_size * world:
        raise ValueError(f"--batch-size {cfg.batch_size} x {world} ranks exceeds the {len(train_set)} training images")
    torch.manual_seed(cfg.seed)
    model.to(device)
    net = model
    sampler = None
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        sampler = torch.utils.data.DistributedSampler(train_set, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = _loader(train_set, cfg.batch_size, True, cfg.workers, device, sampler, drop_last=True, seed=cfg.seed)
    steps_per_epoch = len(loader)
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr)
    warmup = min(int(cfg.warmup_epochs * steps_per_epoch), max(total - 1, 0))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, warmup, cfg.min_lr_ratio))
    ctx, fp16 = _autocast(device, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    mix = None
    if cfg.mixup:
        from timm.data import Mixup

        mix = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=cfg.label_smoothing,
                    num_classes=_num_classes(model))
    out = Path(cfg.out) if cfg.out and rank == 0 else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    progress = _Progress(cfg.progress if rank == 0 else False, cfg.log_lines_per_epoch)
    history, step, final = [], 0, None
    epochs = math.ceil(total / steps_per_epoch) if steps_per_epoch else 0
    try:
        for epoch in range(1, epochs + 1):
            if sampler is not None:
                sampler.set_epoch(epoch)
            net.train()
            n_epoch = min(steps_per_epoch, total - step)
            progress.epoch(epoch, epochs, n_epoch)
            sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
            t0 = time.perf_counter()
            for i, (x, y) in enumerate(loader, 1):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                target = y
                if mix is not None:
                    x, target = mix(x, y)
                with ctx:
                    logits = net(x)
                logits = logits.float()
                if mix is not None:
                    loss = torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()
                else:
                    loss = F.cross_entropy(logits, target, label_smoothing=cfg.label_smoothing)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"loss is {loss.item()} at step {step + 1} (epoch {epoch}); "
                                             f"lower --lr or check the data")
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                if cfg.clip_grad:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
                scaler.step(opt)
                scaler.update()
                sched.step()
                step += 1
                with torch.no_grad():
                    sums += torch.stack([loss.detach() * y.numel(), (logits.argmax(1) == y).sum(),
                                         torch.tensor(y.numel(), device=device)]).double()
                if rank == 0 and progress.wants(i):
                    progress.step(i, f"loss {sums[0].item() / sums[2].item():.4f} lr {sched.get_last_lr()[0]:.2e}")
                if i >= n_epoch:
                    break
            seconds = time.perf_counter() - t0
            if world > 1:
                import torch.distributed as dist

                dist.all_reduce(sums)
            loss_sum, correct, count = sums.tolist()
            record = {"epoch": epoch, "step": step, "train_loss": loss_sum / count,
                      "train_top1": None if mix is not None else 100 * correct / count,
                      "train_images_per_s": count / seconds, "lr": sched.get_last_lr()[0], "seconds": seconds}
            if val_set is not None:
                if rank == 0:
                    progress.note(f"validating on {len(val_set)} images")
                final = evaluate_model(model, val_set, batch_size=cfg.batch_size, device=device, amp=cfg.amp,
                                       amp_dtype=cfg.amp_dtype, workers=cfg.workers)
                record.update({f"val_{k}": v for k, v in final.items() if k in ("loss", "top1", "top5")})
            history.append(record)
            if rank == 0:
                _print_epoch(record)
                if out:
                    with open(out / "metrics.jsonl", "a") as fh:
                        fh.write(json.dumps(record) + "\n")
                if on_epoch is not None:
                    on_epoch(record)
    finally:
        progress.close()
    return {"history": history, "steps": step, "final": final}


def _num_classes(model: nn.Module) -> int:
    n = getattr(model, "num_classes", None)
    if not n:
        raise ValueError("mixup needs model.num_classes")
    return n


def _print_epoch(r: dict) -> None:
    val = f" val loss {r['val_loss']:.4f} top1 {r['val_top1']:.2f}% top5 {r['val_top5']:.2f}%" if "val_loss" in r \
        else ""
    train_acc = f" top1 {r['train_top1']:.2f}%" if r["train_top1"] is not None else ""
    print(f"epoch {r['epoch']} (step {r['step']}): train loss {r['train_loss']:.4f}{train_acc}{val} "
          f"{r['train_images_per_s']:.0f} img/s {r['seconds']:.1f} s", flush=True)


def save_checkpoint(path: str | os.PathLike, model: SoftViT, name: str, classes: list[str], extra: dict) -> None:
    """``{"model", "config", "classes", "state_dict", ...}``, written to a temporary file and renamed."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": name, "config": asdict(model.cfg), "classes": list(classes),
                "state_dict": model.state_dict(), **extra}, tmp)
    tmp.replace(path)


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> tuple[SoftViT, dict]:
    """Rebuild the model a checkpoint of ``hpdl vision train`` holds; returns (model, checkpoint dict).
    Raises FileNotFoundError, or ValueError if it is not such a checkpoint (also a file torch cannot load: its
    own message advises ``weights_only=False``, which is unsafe and no fix for a file that is not one)."""
    import pickle

    if not Path(path).is_file():
        raise FileNotFoundError(f"--checkpoint {path}: no such file")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:   # truncated or foreign
        raise ValueError(f"--checkpoint {path}: not a checkpoint written by `hpdl vision train` (torch.load "
                         f"could not read it: {type(exc).__name__})") from exc
    if isinstance(ckpt, dict) and ckpt.get("format") == "hpdl.vision.detect/1":
        # a detection checkpoint of `hpdl vision train` (SPRNet, RetinaNet, Mask R-CNN): name what it holds
        name = (ckpt.get("spec") or {}).get("name", "?")
        raise ValueError(f"--checkpoint {path} holds a {name!r} detection model, not a classifier: evaluate it "
                         f"with --model {name}")
    if not isinstance(ckpt, dict) or "config" not in ckpt or "state_dict" not in ckpt:
        raise ValueError(f"--checkpoint {path}: not a checkpoint written by `hpdl vision train`")
    model = SoftViT(SoftConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["state_dict"])
    return model, ckpt


# ---------------------------------------------------------------- CLI (the task-module contract of vision/cli.py)

@dataclass(kw_only=True)
class TrainOptions(TrainRun):
    """``hpdl vision train`` of a classifier: the shared schedule and the classification recipe."""

    attention: str = option("soft", choices=("soft", "sdpa"),
                            help="SOFT models: their Gaussian-kernel attention, or softmax SDPA over the same Q/K "
                                 "(a baseline) (default: soft)")
    label_smoothing: float = option(0.1, type=real(0, 1), help="(default: 0.1)")
    drop_path: float | None = option(None, type=real(0, 1),
                                     help="stochastic depth rate (default: 0.1 for ImageFolder data, 0 for the "
                                          "offline set)")
    augment: str = option("basic", choices=("basic", "deit"),
                          help="basic: random resized crop + flip; deit: RandAugment, random erasing, Mixup/CutMix "
                               "(the official SOFT recipe) (default: basic)")
    amp_dtype: str = option("bf16", choices=("bf16", "fp16"),
                            help="autocast dtype when --amp is on; fp16 adds a gradient scaler (default: bf16)")


@dataclass(kw_only=True)
class EvaluateOptions(EvaluateRun):
    """``hpdl vision evaluate`` of a classifier (no options beyond the shared ones)."""


def _split(data: str | None, split: str, image_size: int, augment: str = "basic"):
    """The ImageFolder ``split`` of ``data`` (default: the offline shapes set) with its transforms."""
    from hpdl.vision.datasets import classification_transforms, image_folder, write_shapes

    root = Path(data) if data else write_shapes()
    try:
        return image_folder(root, split, classification_transforms(image_size, split == "train", augment))
    except FileNotFoundError as exc:
        raise CLIUsageError(str(exc)) from None


def _init_distributed(device: torch.device) -> None:
    import torch.distributed as dist

    from hpdl.runtime.launch import init_from_env

    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        # the launch mode's backend and device: NCCL, or gloo when ranks share a GPU (HPDL_RANKS_PER_GPU > 1)
        init_from_env(device.type)


def train(options: TrainOptions) -> int:
    """``hpdl vision train --model soft_*``: train a classifier, checkpoint each epoch, print the final metrics.

    Raises:
        CLIUsageError: a bad device, image size, dataset folder or class layout (named).
    """
    try:
        device = resolve_device(options.device)
    except ValueError as exc:
        raise CLIUsageError(str(exc)) from None
    _init_distributed(device)
    rank, world = _dist()
    offline = options.data is None
    image_size = options.image_size or (OFFLINE_IMAGE_SIZE if offline else 224)
    if image_size % 32:
        raise CLIUsageError(f"--image-size must be a multiple of 32 for SOFT models, got {image_size}")
    if offline and rank == 0:
        from hpdl.vision.datasets import write_shapes

        write_shapes()  # rank 0 makes it; the others wait at the barrier below
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    train_set = _split(options.data, "train", image_size, options.augment)
    val_set = _split(options.data, "val", image_size)
    root = Path(train_set.root).parent
    if train_set.classes != val_set.classes:
        raise CLIUsageError(f"--data {root}: train/ and val/ hold different class folders")
    drop_path = options.drop_path if options.drop_path is not None else (0.0 if offline else 0.1)
    model = create(options.model, num_classes=len(train_set.classes), img_size=image_size, attention=options.attention,
                   drop_path_rate=drop_path)
    cfg = TrainConfig(epochs=options.epochs or (15 if offline else 300),
                      batch_size=options.batch_size or (64 if offline else 128), lr=options.lr or 1e-3,
                      weight_decay=options.weight_decay if options.weight_decay is not None else 0.05,
                      warmup_epochs=(options.warmup_epochs if options.warmup_epochs is not None
                                     else (1 if offline else 10)),
                      clip_grad=options.clip_grad if options.clip_grad is not None else 1.0,
                      label_smoothing=options.label_smoothing, mixup=options.augment == "deit",
                      max_steps=options.max_steps,
                      device=str(device), amp=options.amp, amp_dtype=options.amp_dtype, workers=options.workers,
                      seed=options.seed, out=options.out)
    if rank == 0:
        print(f"# {options.model}: {model.num_params() / 1e6:.2f}M parameters, {len(train_set.classes)} classes, "
              f"{len(train_set)} train / {len(val_set)} val images from {root}, {image_size}px, {world} x {device}",
              flush=True)
    ckpt = Path(options.out) / "checkpoint.pt"

    def save(record):
        save_checkpoint(ckpt, model, options.model, train_set.classes,
                        {"epoch": record["epoch"], "step": record["step"], "image_size": image_size,
                         "metrics": record})

    result = fit(model, train_set, val_set, cfg, on_epoch=save)
    if rank == 0 and result["final"]:
        f = result["final"]
        print(f"# done: {result['steps']} steps; val top1 {f['top1']:.2f}% top5 {f['top5']:.2f}% loss "
              f"{f['loss']:.4f}; checkpoint {ckpt}")
    return 0


def evaluate(options: EvaluateOptions) -> int:
    """``hpdl vision evaluate --model soft_* --checkpoint CKPT``: top-1/top-5 and loss on the val split, as JSON.

    Raises:
        CLIUsageError: a bad device or checkpoint, another model's checkpoint, or other classes (named).
    """
    try:
        device = resolve_device(options.device)
        model, ckpt = load_checkpoint(options.checkpoint)
    except (ValueError, FileNotFoundError) as exc:
        raise CLIUsageError(str(exc)) from None
    _init_distributed(device)
    if ckpt.get("model") != options.model:
        raise CLIUsageError(f"--model {options.model!r} but {options.checkpoint} holds {ckpt.get('model')!r}")
    image_size = options.image_size or ckpt.get("image_size", 224)
    val_set = _split(options.data, "val", image_size)
    root = Path(val_set.root).parent
    if val_set.classes != ckpt["classes"]:
        raise CLIUsageError(f"--data {root}: its classes differ from the checkpoint's ({len(ckpt['classes'])})")
    res = evaluate_model(model.to(device), val_set, batch_size=options.batch_size or 128, device=device,
                         amp=options.amp, workers=options.workers)
    if _dist()[0] == 0:
        print(json.dumps({"model": options.model, "checkpoint": str(options.checkpoint), "data": str(root),
                          "image_size": image_size, **res}))
    return 0


@dataclass(kw_only=True)
class MakeClassesOptions(Options):
    """``hpdl vision make-classes``: the offline classification set (:func:`hpdl.vision.datasets.write_shapes`)."""

    out: str | None = option(None, help="folder to write (default: $HPDL_DATA_DIR/shapes-v1, i.e. the offline "
                             "default of `hpdl vision train`)")
    train_per_class: int = option(300, type=count(1, 1 << 20), help="(default: 300)")
    val_per_class: int = option(60, type=count(1, 1 << 20), help="(default: 60)")
    image_size: int = option(OFFLINE_IMAGE_SIZE, type=count(8, 8192), help=f"(default: {OFFLINE_IMAGE_SIZE})")
    num_classes: int = option(10, type=count(2, 10), help="2..10 (default: 10)")
    seed: int = option(0, type=count(0, 2**32 - 1), help="random seed, >= 0 (default: 0)")
    overwrite: bool = option(False, help="replace a different dataset in --out")


def make_classes(options: MakeClassesOptions) -> int:
    """Write the set and print its folder.

    Raises:
        CLIUsageError: bad sizes, or a different dataset already in ``out`` without ``overwrite``.
    """
    from hpdl.vision.datasets import write_shapes

    o = options
    try:
        root = write_shapes(o.out, o.train_per_class, o.val_per_class, o.image_size, o.num_classes, o.seed,
                            o.overwrite)
    except (ValueError, FileExistsError) as exc:
        raise CLIUsageError(str(exc)) from None
    print(root)
    return 0


COMMANDS = {"make-classes": ("write the offline classification set (procedural shapes, ImageFolder layout)",
                            MakeClassesOptions, make_classes)}
