"""nanoGPT-style data-parallel training of :class:`hpdl.models.nanogpt.GPT` on a local byte-level corpus.

Gradient averaging is the only thing that changes between the communicators:

- ``hpdl``: the plain module with :class:`hpdl.comm.hooks.BucketAllReduce` (buckets all-reduced through
  hpdl.comm as their gradients become ready, waited before the optimizer step);
- ``hpdl-ddp``: ``DistributedDataParallel`` with hpdl's communication hook (:func:`hpdl.comm.hooks.register`);
- ``nccl``: plain ``DistributedDataParallel`` with the process group's backend (NCCL on CUDA, gloo on CPU).

Batches are drawn for the global batch from a generator seeded by ``(seed, step)`` and each rank takes its
rows, so any world size (1 included) trains on the same samples: with equal per-rank batches the averaged
gradient is the single-process gradient of the global batch, and loss curves agree up to rounding.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import statistics
import sysconfig
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

from hpdl.apps.comm import comm_label, synchronize
from hpdl.models.nanogpt import GPT, GPTConfig
from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.limits import count, real
from hpdl.runtime.options import Options, option

TRAIN_COMMS = ("hpdl", "hpdl-ddp", "nccl")


_COMM_HELP = ("hpdl: hpdl.comm's collectives (--algorithm); nccl: torch.distributed on the process group's own "
              "backend, which is NCCL with --device cuda and gloo with --device cpu (the output says which ran)")


@dataclass(kw_only=True)
class TrainConfig(Options):
    """Every knob of a run (``examples/train_gpt.py`` generates its ``--flags`` from these fields)."""

    comm: str = option("hpdl", choices=TRAIN_COMMS, help=_COMM_HELP + "; hpdl-ddp: DistributedDataParallel with "
                       "hpdl's communication hook (no mpi: training runs on torch.distributed; cg.py and fft3d.py "
                       "take --comm mpi)")
    device: str = option("cpu", choices=("cpu", "cuda"), help="cpu or cuda (one GPU per rank: LOCAL_RANK)")
    algorithm: str = option("auto", help="hpdl.comm all-reduce algorithm of the gradient buckets (--comm hpdl, "
                            "hpdl-ddp)")
    steps: int = option(50, type=count(1, 1 << 24), help="optimizer steps")
    batch_size: int = option(8, type=count(1, 1 << 16), help="sequences per rank per micro-step")
    grad_accum: int = option(1, type=count(1, 1 << 16),
                             help="micro-steps per optimizer step (gradients are communicated on the last only)")
    block_size: int = option(128, type=count(1, 1 << 20), help="context length in bytes (tokens)")
    n_layer: int = option(4, type=count(1, 1024), help="transformer blocks")
    n_head: int = option(4, type=count(1, 1024), help="attention heads per block")
    n_embd: int = option(128, type=count(1, 1 << 16), help="embedding width (a multiple of --n-head)")
    learning_rate: float = option(1e-3, type=real(0, 10, strict=True), help="peak AdamW learning rate")
    min_lr: float = option(1e-4, type=real(0, 10), help="learning rate at the last step (cosine decay)")
    warmup_steps: int = option(10, type=count(0, 1 << 24), help="linear learning-rate warm-up steps")
    weight_decay: float = option(0.1, type=real(0, 10), help="AdamW weight decay (matrices only)")
    grad_clip: float = option(1.0, type=real(0, 1e6), help="clip the gradient norm to this (0: off)")
    bucket_mb: float = option(25.0, type=real(0, 1 << 20, strict=True),
                              help="gradient bucket cap in MiB (DDP's default 25)")
    first_bucket_mb: float = option(1.0, type=real(0, 1 << 20, strict=True),
                                    help="first (last-layer) bucket cap in MiB, so communication starts early")
    dtype: str = option("float32", choices=("float32", "bfloat16"), help="float32, or bfloat16 under autocast")
    seed: int = option(1337, type=count(0, 2**63 - 1), help="seed of the weights and of the batches")
    data: str = option("", help="a text file or a directory of *.py / *.txt (empty: the Python standard "
                       "library's source)")
    log_interval: int = option(10, type=count(1, 1 << 24), help="print a loss line every this many steps")
    timing_warmup: int = option(3, type=count(0, 1 << 24), help="first steps left out of the step-time statistics")

    def __post_init__(self):
        if self.comm not in TRAIN_COMMS:
            raise ValueError(f"comm must be one of {TRAIN_COMMS}, got {self.comm!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        for name in ("steps", "batch_size", "grad_accum", "block_size", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:   # the heads split the embedding evenly
            raise CLIUsageError(f"n_embd (--n-embd) must be a multiple of n_head (--n-head)={self.n_head}, got "
                                f"{self.n_embd}")


_CORPUS: dict[str, torch.Tensor] = {}


def corpus_files(path: str = "") -> list[str]:
    """The files of the corpus, sorted: ``path`` itself, the *.py and *.txt under it, or (empty) the Python
    standard library's *.py without site-packages and test suites (about 12 MB on CPython 3.11)."""
    if path and os.path.isfile(path):
        return [path]
    root = path or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise FileNotFoundError(f"data={path!r} is neither a file nor a directory")
    pats = ("*.py",) if not path else ("*.py", "*.txt")
    files = sorted({f for pat in pats for f in glob.glob(os.path.join(root, "**", pat), recursive=True)})
    skip = ("site-packages", f"{os.sep}test{os.sep}", f"{os.sep}tests{os.sep}", f"{os.sep}idle_test{os.sep}")
    if not path:
        files = [f for f in files if not any(s in f for s in skip)]
    if not files:
        raise FileNotFoundError(f"no *.py or *.txt files under {root!r}")
    return files


def load_corpus(path: str = "") -> torch.Tensor:
    """The corpus as a uint8 tensor of bytes (vocabulary 256), cached per process."""
    if path not in _CORPUS:
        chunks = []
        for f in corpus_files(path):
            with open(f, "rb") as fh:
                chunks.append(fh.read())
        _CORPUS[path] = torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8)
    return _CORPUS[path]


def get_batch(data: torch.Tensor, step: int, micro: int, cfg: TrainConfig, world: int, rank: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(x, y)``, int64 ``[batch_size, block_size]``: rows ``rank`` of micro-step ``micro`` of the
    global batch of ``step`` (``grad_accum x world x batch_size`` offsets from one seeded generator)."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    ix = torch.randint(len(data) - cfg.block_size - 1, (cfg.grad_accum * world * cfg.batch_size,), generator=g)
    ix = ix.view(cfg.grad_accum, world, cfg.batch_size)[micro, rank]
    rows = data[ix[:, None] + torch.arange(cfg.block_size + 1)].long()  # (B, T + 1)
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``learning_rate``, then cosine decay to ``min_lr`` (nanoGPT's schedule)."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - 1 - cfg.warmup_steps)
    ratio = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def train(cfg: TrainConfig, log: Callable[[str], None] | None = print) -> dict:
    """Train ``cfg.steps`` steps on the current torch.distributed job (or one process if none is set up).

    Returns a dict: ``losses`` (global mean training loss per step, the same on every rank), ``step_ms``
    (wall time of each step on this rank), ``median_step_ms`` and ``tokens_per_s`` over the steps after
    ``timing_warmup``, ``tokens_per_step``, ``params``, ``flops_per_token``, ``world_size``, ``buckets`` and
    ``config``. ``log`` receives progress lines on rank 0 (None = silent).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    data = load_corpus(cfg.data)
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(block_size=cfg.block_size, vocab_size=256, n_layer=cfg.n_layer, n_head=cfg.n_head,
                          n_embd=cfg.n_embd)).to(device)
    net, grads, buckets = model, None, None
    if world > 1:
        if cfg.comm == "hpdl":
            from hpdl.comm.hooks import BucketAllReduce

            grads = BucketAllReduce(model.parameters(), bucket_cap_mb=cfg.bucket_mb,
                                    first_bucket_mb=cfg.first_bucket_mb, algorithm=cfg.algorithm)
            buckets = len(grads.buckets)
        else:
            net = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cfg.bucket_mb)
            if cfg.comm == "hpdl-ddp":
                from hpdl.comm.hooks import register

                register(net, algorithm=cfg.algorithm)
    opt = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, device_type=device.type)
    no_sync = grads.no_sync if grads is not None else getattr(net, "no_sync", contextlib.nullcontext)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16"
                else contextlib.nullcontext())
    tokens = cfg.batch_size * cfg.block_size * cfg.grad_accum * world
    losses: list[float] = []
    pending: list[torch.Tensor] = []
    step_ms: list[float] = []
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        synchronize(device)
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            x, y = get_batch(data, step, micro, cfg, world, rank, device)
            with no_sync() if micro < cfg.grad_accum - 1 else contextlib.nullcontext():
                with autocast:
                    _, loss = net(x, y)
                (loss / cfg.grad_accum).backward()
            total += loss.detach()
        if grads is not None:
            grads.wait()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        step_ms.append(1e3 * (time.perf_counter() - t0))
        pending.append(total / cfg.grad_accum)
        if (step + 1) % cfg.log_interval == 0 or step == cfg.steps - 1:  # untimed: global mean of the window
            window = torch.stack(pending).float()
            if world > 1:
                dist.all_reduce(window)
                window /= world
            losses += window.cpu().tolist()
            pending = []
            if log is not None and rank == 0:
                recent = step_ms[-len(window):]
                ms = statistics.median(recent)
                log(f"step {step + 1:5d} | loss {losses[-1]:.4f} | step {ms:8.1f} ms | "
                    f"{tokens / ms * 1e3:10.0f} tok/s | {comm_label(cfg.comm)} x{world} {device.type}")
    if grads is not None:
        grads.remove()
    timed = step_ms[cfg.timing_warmup:] or step_ms
    median = statistics.median(timed)
    return {"losses": losses, "step_ms": step_ms, "median_step_ms": median, "tokens_per_s": tokens / median * 1e3,
            "tokens_per_step": tokens, "params": model.num_params(), "flops_per_token": model.flops_per_token(),
            "world_size": world, "buckets": buckets, "config": asdict(cfg)}
