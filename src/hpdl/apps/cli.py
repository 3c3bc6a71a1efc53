"""Command lines of the three applications (``examples/*.py`` call these ``main`` functions).

Options come from dataclasses (defaults in one visible block, nanoGPT-style, no ``exec``); the job comes
from torchrun / mpirun / srun variables, or is one process when none are set. Rank 0 prints one line per
result and, with ``--json PATH``, writes the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass

import torch

from hpdl.apps.comm import COMMS, comm_label
from hpdl.runtime.limits import count, real


@dataclass
class CGArgs:
    comm: str = "hpdl"           # hpdl | nccl | mpi
    device: str = "cpu"
    size: int = 32               # interior points per dimension: the global grid is size^3
    iters: int = 200             # timed iterations (fixed: no early exit)
    warmup: int = 20
    dtype: str = "float64"       # float64 | float32 (hpdl's CUDA peer kernels reduce float32, not float64)
    algorithm: str = "auto"      # hpdl.comm.all_reduce algorithm (comm=hpdl)
    window: int = 0              # direct algorithm's throttle (0 = tuned)
    json: str = ""


@dataclass
class FFTArgs:
    comm: str = "hpdl"
    device: str = "cpu"
    shape: str = "64,64,64"      # global N0,N1,N2
    grid: str = ""               # P0,P1 (default: the most square)
    iters: int = 10
    warmup: int = 2
    dtype: str = "complex64"     # complex64 | complex128
    algorithm: str = "auto"      # hpdl.comm.all_to_all_single algorithm (comm=hpdl): auto, pairwise, direct, ...
    window: int = 0
    json: str = ""


_COMM = ("hpdl: hpdl.comm's collectives (--algorithm); nccl: torch.distributed on the process group's own "
         "backend, which is NCCL with --device cuda and gloo with --device cpu (the output says which ran)")
HELP: dict[str, str] = {   # one line per option of the three scripts (shown by --help with its default)
    "comm": _COMM + "; mpi: mpi4py (mpirun -n N; needs hpdl[mpi])",
    "device": "cpu or cuda (one GPU per rank: LOCAL_RANK)",
    "size": "interior grid points per dimension: the global grid is size^3",
    "iters": "timed iterations (fixed count: no early exit)",
    "warmup": "untimed iterations before the timed ones",
    "dtype": "element type of the data",
    "algorithm": "hpdl.comm algorithm with --comm hpdl (auto, direct, ring, ...; docs/comm.md)",
    "window": "direct algorithm's throttle window in messages (0: from the tuning table)",
    "json": "write the result here as JSON (rank 0)",
    "shape": "global grid N0,N1,N2",
    "grid": "process grid P0,P1 with P0*P1 = ranks (empty: the most square)",
    # train_gpt.py (hpdl.apps.train.TrainConfig)
    "steps": "optimizer steps",
    "batch_size": "sequences per rank per micro-step",
    "grad_accum": "micro-steps per optimizer step (gradients are communicated on the last only)",
    "block_size": "context length in bytes (tokens)",
    "n_layer": "transformer blocks",
    "n_head": "attention heads per block",
    "n_embd": "embedding width (a multiple of --n-head)",
    "learning_rate": "peak AdamW learning rate",
    "min_lr": "learning rate at the last step (cosine decay)",
    "warmup_steps": "linear learning-rate warm-up steps",
    "weight_decay": "AdamW weight decay (matrices only)",
    "grad_clip": "clip the gradient norm to this (0: off)",
    "bucket_mb": "gradient bucket cap in MiB (DDP's default 25)",
    "first_bucket_mb": "first (last-layer) bucket cap in MiB, so communication starts early",
    "seed": "seed of the weights and of the batches",
    "data": "a text file or a directory of *.py / *.txt (empty: the Python standard library's source)",
    "log_interval": "print a loss line every this many steps",
    "timing_warmup": "first steps left out of the step-time statistics",
}


# The range of every numeric option (argparse types: a value outside is a usage error naming the option), so no
# 0, negative or huge value can start a run that fails late or never ends (issue 37).
TYPES: dict[str, object] = {
    "size": count(2, 4096), "iters": count(1, 1 << 24), "warmup": count(0, 1 << 20), "window": count(0, 1 << 20),
    "steps": count(1, 1 << 24), "batch_size": count(1, 1 << 16), "grad_accum": count(1, 1 << 16),
    "block_size": count(1, 1 << 20), "n_layer": count(1, 1024), "n_head": count(1, 1024),
    "n_embd": count(1, 1 << 16), "learning_rate": real(0, 10, strict=True), "min_lr": real(0, 10),
    "warmup_steps": count(0, 1 << 24), "weight_decay": real(0, 10), "grad_clip": real(0, 1e6),
    "bucket_mb": real(0, 1 << 20, strict=True), "first_bucket_mb": real(0, 1 << 20, strict=True),
    "seed": count(0, 2**63 - 1), "log_interval": count(1, 1 << 24), "timing_warmup": count(0, 1 << 24),
}


def parser_for(cls, prog: str, description: str, choices: dict | None = None,
               helps: dict | None = None) -> argparse.ArgumentParser:
    """``--field`` for every dataclass field, typed by :data:`TYPES` (else by its default), with a help line
    (``helps``, else :data:`HELP`) and its default; bools take true/false."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    helps = {**HELP, **(helps or {})}
    for f in dataclasses.fields(cls):
        default = f.default
        kind = TYPES.get(f.name, type(default))
        if kind is bool:
            kind = lambda v: v.lower() in ("1", "true", "yes")  # noqa: E731
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=default,
                       choices=(choices or {}).get(f.name), help=helps.get(f.name, " "))
    return p


def _emit(comm, line: str, payload: dict, path: str) -> None:
    if comm.rank != 0:
        return
    print(line, flush=True)
    if path:
        with open(path, "w") as fh:
            json.dump(payload, fh, indent=1)


def _fits(need: int, flag: str, device: str, what: str) -> None:
    """Exit with a usage error naming ``flag`` when ``need`` bytes per rank cannot fit (before allocating)."""
    from hpdl.runtime.limits import check_fits

    try:
        check_fits(need, flag, device="cuda" if device == "cuda" else "cpu", what=what)
    except MemoryError as exc:
        raise SystemExit(f"error: {exc}") from None


def main_cg(argv=None) -> int:
    from hpdl.apps import cg
    from hpdl.apps.comm import launch

    a = parser_for(CGArgs, "cg.py", "distributed CG on the 3-D Poisson problem",
                   {"comm": COMMS, "device": ("cpu", "cuda"), "dtype": ("float64", "float32")}).parse_args(argv)
    comm = launch(a.comm, a.device, algorithm=a.algorithm, window=a.window or None)
    _fits(6 * a.size ** 3 * getattr(torch, a.dtype).itemsize // comm.size, "--size", a.device,
          f"CG's 6 vectors of a {a.size}^3 grid over {comm.size} rank(s)")   # x, b, r, p, Ap + halo planes
    res = cg.solve(comm, a.size, a.iters, dtype=getattr(torch, a.dtype), warmup=a.warmup, breakdown=True)
    parts = "" if res.allreduce_s is None else \
        f" (dot all-reduces {res.allreduce_s * 1e6:.1f} us, halo waits {res.halo_s * 1e6:.1f} us)"
    label = comm_label(a.comm, a.algorithm)
    _emit(comm, f"cg {a.size}^3 ranks={comm.size} comm={label} {a.device} {a.dtype}: "
                f"{res.time_s * 1e6:.1f} us/iter{parts}; |r| {res.residuals[0]:.3e} -> {res.residuals[-1]:.3e} "
                f"after {a.warmup + a.iters} iterations",
          {"args": vars(a), **dataclasses.asdict(res) | {"x": None}}, a.json)
    return 0


def main_fft(argv=None) -> int:
    from hpdl.apps import fft3d
    from hpdl.apps.comm import launch

    p = parser_for(FFTArgs, "fft3d.py", "pencil-decomposed 3-D FFT",
                   {"comm": COMMS, "device": ("cpu", "cuda"), "dtype": ("complex64", "complex128")})
    a = p.parse_args(argv)

    def extents(flag: str, text: str, n: int) -> tuple[int, ...]:
        # a usage error (exit 2) naming the flag, before any rank starts: '8,8' and 'a,b,c' ended in tracebacks
        try:
            out = tuple(int(s) for s in text.split(","))
        except ValueError:
            out = ()
        if len(out) != n or any(v < 1 for v in out):
            p.error(f"argument {flag}: expected {n} comma-separated integers >= 1, got {text!r}")
        return out

    shape = extents("--shape", a.shape, 3)
    grid = extents("--grid", a.grid, 2) if a.grid else None
    comm = launch(a.comm, a.device, alltoall_algorithm=a.algorithm, window=a.window or None)
    _fits(6 * math.prod(shape) * getattr(torch, a.dtype).itemsize // comm.size, "--shape", a.device,
          f"a {a.shape} transform's input, output and all-to-all buffers over {comm.size} rank(s)")
    res = fft3d.run(comm, shape, a.iters, dtype=getattr(torch, a.dtype), warmup=a.warmup, grid=grid, breakdown=True)
    parts = "" if res.alltoall_s is None else (f" (local FFTs {res.fft_s * 1e3:.2f} ms, pack/unpack "
                                               f"{res.pack_s * 1e3:.2f} ms, all-to-alls {res.alltoall_s * 1e3:.2f} ms)")
    label = comm_label(a.comm, a.algorithm)
    out = dataclasses.asdict(res)
    out.update(y=None, box=None)
    _emit(comm, f"fft3d {'x'.join(map(str, shape))} grid={'x'.join(map(str, res.meta['grid']))} comm={label} "
                f"{a.device} {a.dtype}: {res.time_s * 1e3:.2f} ms/transform{parts}", {"args": vars(a), **out}, a.json)
    return 0


def main_train(argv=None) -> int:
    from hpdl.apps.comm import launch
    from hpdl.apps.train import TRAIN_COMMS, TrainConfig, train

    p = parser_for(TrainConfig, "train_gpt.py", "nanoGPT-style data-parallel training on hpdl.comm",
                   {"comm": TRAIN_COMMS, "device": ("cpu", "cuda"), "dtype": ("float32", "bfloat16")},
                   {"comm": _COMM + "; hpdl-ddp: DistributedDataParallel with hpdl's communication hook (no mpi: "
                            "training runs on torch.distributed; cg.py and fft3d.py take --comm mpi)",
                    "algorithm": "hpdl.comm all-reduce algorithm of the gradient buckets (--comm hpdl, hpdl-ddp)",
                    "dtype": "float32, or bfloat16 under autocast"})
    p.add_argument("--json", default="", help="write losses and step times (rank 0)")
    a = p.parse_args(argv)
    path = a.__dict__.pop("json")
    try:
        cfg = TrainConfig(**vars(a))
    except ValueError as exc:
        p.error(str(exc))
    comm = launch("nccl" if cfg.comm == "nccl" else "hpdl", cfg.device)
    out = train(cfg)
    out["backend"] = comm_label(cfg.comm)
    _emit(comm, f"train_gpt {comm_label(cfg.comm)} x{out['world_size']} {cfg.device}: median step {out['median_step_ms']:.1f} ms, "
                f"{out['tokens_per_s']:.0f} tok/s, final loss {out['losses'][-1]:.4f}, {out['params']} params",
          out, path)
    return 0

