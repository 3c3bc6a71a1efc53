"""Command lines of the three applications (``examples/*.py`` call these ``main`` functions).

Options come from dataclasses (defaults in one visible block, nanoGPT-style, no ``exec``); the job comes
from torchrun / mpirun / srun variables, or is one process when none are set. Rank 0 prints one line per
result and, with ``--json PATH``, writes the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

import torch

from hpdl.apps.comm import COMMS


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


def parser_for(cls, prog: str, description: str, choices: dict | None = None) -> argparse.ArgumentParser:
    """``--field`` for every dataclass field, typed by its default; bools take true/false."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(cls):
        default = f.default
        kind = type(default)
        if kind is bool:
            kind = lambda v: v.lower() in ("1", "true", "yes")  # noqa: E731
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=default,
                       choices=(choices or {}).get(f.name))
    return p


def _emit(comm, line: str, payload: dict, path: str) -> None:
    if comm.rank != 0:
        return
    print(line, flush=True)
    if path:
        with open(path, "w") as fh:
            json.dump(payload, fh, indent=1)


def main_cg(argv=None) -> int:
    from hpdl.apps import cg
    from hpdl.apps.comm import launch

    a = parser_for(CGArgs, "cg.py", "distributed CG on the 3-D Poisson problem",
                   {"comm": COMMS, "device": ("cpu", "cuda"), "dtype": ("float64", "float32")}).parse_args(argv)
    comm = launch(a.comm, a.device, algorithm=a.algorithm, window=a.window or None)
    res = cg.solve(comm, a.size, a.iters, dtype=getattr(torch, a.dtype), warmup=a.warmup, breakdown=True)
    parts = "" if res.allreduce_s is None else \
        f" (dot all-reduces {res.allreduce_s * 1e6:.1f} us, halo waits {res.halo_s * 1e6:.1f} us)"
    label = a.comm + (f"({a.algorithm})" if a.comm == "hpdl" else "")
    _emit(comm, f"cg {a.size}^3 ranks={comm.size} comm={label} {a.device} {a.dtype}: "
                f"{res.time_s * 1e6:.1f} us/iter{parts}; |r| {res.residuals[0]:.3e} -> {res.residuals[-1]:.3e} "
                f"after {a.warmup + a.iters} iterations",
          {"args": vars(a), **dataclasses.asdict(res) | {"x": None}}, a.json)
    return 0


def main_fft(argv=None) -> int:
    from hpdl.apps import fft3d
    from hpdl.apps.comm import launch

    a = parser_for(FFTArgs, "fft3d.py", "pencil-decomposed 3-D FFT",
                   {"comm": COMMS, "device": ("cpu", "cuda"), "dtype": ("complex64", "complex128")}
                   ).parse_args(argv)
    shape = tuple(int(s) for s in a.shape.split(","))
    grid = tuple(int(s) for s in a.grid.split(",")) if a.grid else None
    comm = launch(a.comm, a.device, alltoall_algorithm=a.algorithm, window=a.window or None)
    res = fft3d.run(comm, shape, a.iters, dtype=getattr(torch, a.dtype), warmup=a.warmup, grid=grid, breakdown=True)
    parts = "" if res.alltoall_s is None else (f" (local FFTs {res.fft_s * 1e3:.2f} ms, pack/unpack "
                                               f"{res.pack_s * 1e3:.2f} ms, all-to-alls {res.alltoall_s * 1e3:.2f} ms)")
    label = a.comm + (f"({a.algorithm})" if a.comm == "hpdl" else "")
    out = dataclasses.asdict(res)
    out.update(y=None, box=None)
    _emit(comm, f"fft3d {'x'.join(map(str, shape))} grid={'x'.join(map(str, res.meta['grid']))} comm={label} "
                f"{a.device} {a.dtype}: {res.time_s * 1e3:.2f} ms/transform{parts}", {"args": vars(a), **out}, a.json)
    return 0


def main_train(argv=None) -> int:
    from hpdl.apps.comm import launch
    from hpdl.apps.train import TRAIN_COMMS, TrainConfig, train

    p = parser_for(TrainConfig, "train_gpt.py", "nanoGPT-style data-parallel training on hpdl.comm",
                   {"comm": TRAIN_COMMS, "device": ("cpu", "cuda"), "dtype": ("float32", "bfloat16")})
    p.add_argument("--json", default="", help="write losses and step times (rank 0)")
    a = p.parse_args(argv)
    path = a.__dict__.pop("json")
    cfg = TrainConfig(**vars(a))
    comm = launch("nccl" if cfg.comm == "nccl" else "hpdl", cfg.device)
    out = train(cfg)
    _emit(comm, f"train_gpt {cfg.comm} x{out['world_size']} {cfg.device}: median step {out['median_step_ms']:.1f} ms, "
                f"{out['tokens_per_s']:.0f} tok/s, final loss {out['losses'][-1]:.4f}, {out['params']} params",
          out, path)
    return 0

