"""Command lines of the three applications (``examples/*.py`` call these ``main`` functions).

Options are dataclasses whose fields carry their default, help and checked type (defaults in one visible block,
nanoGPT-style, no ``exec``; :mod:`hpdl.runtime.options` generates the flags); the job comes
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
from hpdl.apps.train import TrainConfig
from hpdl.runtime.limits import count
from hpdl.runtime.options import Options, add_arguments, from_namespace, option


_COMM = ("hpdl: hpdl.comm's collectives (--algorithm); nccl: torch.distributed on the process group's own "
         "backend, which is NCCL with --device cuda and gloo with --device cpu (the output says which ran)"
         "; mpi: mpi4py (mpirun -n N; needs hpdl[mpi])")
_DEVICE = "cpu or cuda (one GPU per rank: LOCAL_RANK)"
_ALGORITHM = "hpdl.comm algorithm with --comm hpdl (auto, direct, ring, ...; docs/comm.md)"
_WINDOW = "direct algorithm's throttle window in messages (0: from the tuning table)"
# Every numeric option has a range (argparse types: a value outside is a usage error naming the option), so no
# 0, negative or huge value can start a run that fails late or never ends (issue 37).


@dataclass(kw_only=True)
class CGArgs(Options):
    """``examples/cg.py``: distributed CG on the 3-D Poisson problem."""

    comm: str = option("hpdl", choices=COMMS, help=_COMM)
    device: str = option("cpu", choices=("cpu", "cuda"), help=_DEVICE)
    size: int = option(32, type=count(2, 4096), help="interior grid points per dimension: the global grid is size^3")
    iters: int = option(200, type=count(1, 1 << 24), help="timed iterations (fixed count: no early exit)")
    warmup: int = option(20, type=count(0, 1 << 20), help="untimed iterations before the timed ones")
    dtype: str = option("float64", choices=("float64", "float32"), help="element type of the data (hpdl's CUDA "
                        "peer kernels reduce float32, not float64)")
    algorithm: str = option("auto", help=_ALGORITHM)
    window: int = option(0, type=count(0, 1 << 20), help=_WINDOW)
    json: str = option("", help="write the result here as JSON (rank 0)")


@dataclass(kw_only=True)
class FFTArgs(Options):
    """``examples/fft3d.py``: the pencil-decomposed 3-D FFT."""

    comm: str = option("hpdl", choices=COMMS, help=_COMM)
    device: str = option("cpu", choices=("cpu", "cuda"), help=_DEVICE)
    shape: str = option("64,64,64", help="global grid N0,N1,N2")
    grid: str = option("", help="process grid P0,P1 with P0*P1 = ranks (empty: the most square)")
    iters: int = option(10, type=count(1, 1 << 24), help="timed iterations (fixed count: no early exit)")
    warmup: int = option(2, type=count(0, 1 << 20), help="untimed iterations before the timed ones")
    dtype: str = option("complex64", choices=("complex64", "complex128"), help="element type of the data")
    algorithm: str = option("auto", help="hpdl.comm all-to-all algorithm with --comm hpdl (auto, pairwise, "
                            "direct, ...; docs/comm.md)")
    window: int = option(0, type=count(0, 1 << 20), help=_WINDOW)
    json: str = option("", help="write the result here as JSON (rank 0)")


@dataclass(kw_only=True)
class TrainArgs(TrainConfig):
    """``examples/train_gpt.py``: :class:`hpdl.apps.train.TrainConfig` and where the result goes."""

    json: str = option("", help="write losses and step times (rank 0)")


def parser_for(cls, prog: str, description: str) -> argparse.ArgumentParser:
    """The parser of a script: a ``--flag`` for every option field of dataclass ``cls``
    (:func:`hpdl.runtime.options.add_arguments`), each help line with its default."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p, cls)
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

    a = parser_for(CGArgs, "cg.py", "distributed CG on the 3-D Poisson problem").parse_args(argv)
    comm = launch(a.comm, a.device, algorithm=a.algorithm, window=a.window or None)
    _fits(6 * a.size ** 3 * getattr(torch, a.dtype).itemsize // comm.size, "--size", a.device,
          f"CG's 6 vectors of a {a.size}^3 grid over {comm.size} rank(s)")   # x, b, r, p, Ap + halo planes
    res = cg.solve(comm, a.size, a.iters, dtype=getattr(torch, a.dtype), warmup=a.warmup, breakdown=True)
    parts = "" if res.allreduce_s is None else \
        f" (dot all-reduces {res.allreduce_s * 1e6:.1f} us, halo waits {res.halo_s * 1e6:.1f} us)"
    label = comm_label(a.comm, a.algorithm)
    if a.comm == "hpdl" and a.algorithm == "auto" and a.device == "cpu" and comm.size > 1:
        # what auto ran for CG's one-element dot all-reduces (on CPU the table's pick is the whole answer)
        from hpdl.comm import resolve

        dt = getattr(torch, a.dtype)
        label = f"hpdl(auto->{resolve('all_reduce', dt.itemsize, comm.size, 'cpu', dtype=dt)[0]})"
    _emit(comm, f"cg {a.size}^3 ranks={comm.size} comm={label} {a.device} {a.dtype}: "
                f"{res.time_s * 1e6:.1f} us/iter{parts}; |r| {res.residuals[0]:.3e} -> {res.residuals[-1]:.3e} "
                f"after {a.warmup + a.iters} iterations",
          {"args": vars(a), **dataclasses.asdict(res) | {"x": None}}, a.json)
    return 0


def main_fft(argv=None) -> int:
    from hpdl.apps import fft3d
    from hpdl.apps.comm import launch

    p = parser_for(FFTArgs, "fft3d.py", "pencil-decomposed 3-D FFT")
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
    from hpdl.apps.train import train

    p = parser_for(TrainArgs, "train_gpt.py", "nanoGPT-style data-parallel training on hpdl.comm")
    a = p.parse_args(argv)
    path = a.json
    try:
        cfg = from_namespace(TrainConfig, a)
    except ValueError as exc:
        p.error(str(exc))
    comm = launch("nccl" if cfg.comm == "nccl" else "hpdl", cfg.device)
    out = train(cfg)
    out["backend"] = comm_label(cfg.comm)
    _emit(comm, f"train_gpt {comm_label(cfg.comm)} x{out['world_size']} {cfg.device}: median step {out['median_step_ms']:.1f} ms, "
                f"{out['tokens_per_s']:.0f} tok/s, final loss {out['losses'][-1]:.4f}, {out['params']} params",
          out, path)
    return 0

