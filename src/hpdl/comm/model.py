"""Alpha-beta-gamma cost model of hpdl's Allreduce and Alltoall algorithms, per topology, for scales we cannot run.

Terms (Thakur, Rabenseifner & Gropp, IJHPCA 2005; Hockney's alpha-beta model): ``alpha`` seconds per message,
``beta`` seconds per byte on one link, ``gamma`` seconds per byte reduced. Two link classes: *intra* (inside a
node: NVLink / IPC, or shared memory on CPU) and *inter* (one network rail). A node has ``g`` ranks and ``rails``
NICs; local rank i drives rail i, so when ``rails < g`` ranks share a rail (factor ``g / rails``).
``n`` is the buffer size in bytes (Allreduce) or the bytes each rank sends in total (Alltoall); p = N g ranks.

Allreduce
  ring (1 rail)     2(p-1) steps of n/p bytes, each bounded by an inter-node hop on one rail
                    (topology-unaware flat ring, MPI style): 2(p-1)(a_e + n/p b_e) + (p-1)/p n c
  ring (all rails)  the same with the bytes split over ``rails`` concurrent rings (NCCL style)
  direct (window k) 2 ceil((p-1)/k) a_e + max(2(p-g)/p n b_e s, 2(g-1)/p n b_i) + (p-1)/p n c
  two_level         per chunk (n/C bytes, C = pipeline depth): RS = (g-1)(a_i + n/(gC) b_i + n/(gC) c),
                    inter = ring over N on the rail of n/(gC): 2(N-1)(a_e + n/(NgC) b_e s) + (N-1)/N n/(gC) c;
                    T = RS + inter + (C-1) max(RS, inter) + AG, AG = (g-1)(a_i + n/g b_i)  (AG not pipelined,
                    as implemented); plus ``copy_in`` n b_i when the shared buffer needs a copy (CPU)
Alltoall (block b = n/p)
  pairwise          (g-1)(a_i + b b_i) + (p-g)(a_e + b b_e s)
  direct (window k) ceil((p-1)/k) a_e + max((p-g) b b_e s, (g-1) b b_i)
  push              2 a_i + n b_i (store into the buffer) + max((N-1) a_e + (p-g) b b_e s, g b b_i)
  pull              as push, plus the rail rank's gather of (p-g) b bytes (b_i); with copy_in False
                    (a zero-copy exposure of the input) no store

Every prediction for a configuration that was not measured is a *prediction*: :func:`predict_table` and the
``hpdl bench model`` command label it so. :func:`calibrate` fits a :class:`Machine` to ``hpdl bench --json``
rows by least squares on log time (scipy), so predicted-vs-measured error is printed for what we can run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

MIN_CHUNK_BYTES = 64 << 10  # as hpdl.comm.algorithms.two_level (not imported: the model needs no torch)
ALLREDUCE = ("ring", "ring_all_rails", "direct", "two_level")
ALLTOALL = ("pairwise", "direct", "push", "pull")
FIT = ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "gamma")


@dataclass(frozen=True)
class Machine:
    """Link parameters of one system (seconds, seconds per byte) and where they come from."""

    name: str
    gpus_per_node: int
    rails: int
    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float
    gamma: float
    copy_in: bool = False    # the shared buffer needs a copy of the input (CPU shm: yes; GPU IPC: no)
    window: int = 4
    depth: int = 4
    source: str = ""


# Presets for predictions. Sources: docs/comm.md fact sheet (NDR 400G ~ 46-48 GB/s per rail; H100 NVLink ring
# ~370 GB/s busbw; custom all-reduce floor 4-10 us); alpha_inter and gamma are assumptions [U], stated as such.
PRESETS = {
    "h100-ndr": Machine("h100-ndr", 8, 8, alpha_intra=8e-6, beta_intra=1 / 370e9, alpha_inter=5e-6,
                        beta_inter=1 / 47e9, gamma=1 / 1500e9,
                        source="8 GPUs/node, NVLink ring busbw 370 GB/s, 8 x NDR 400G at 47 GB/s; alpha_inter 5 us "
                               "and gamma 1.5 TB/s assumed [U]"),
    "gh200-ss11": Machine("gh200-ss11", 4, 4, alpha_intra=8e-6, beta_intra=1 / 150e9, alpha_inter=5e-6,
                          beta_inter=1 / 23e9, gamma=1 / 1500e9,
                          source="4 GH200/node (IsambardAI-like), NVLink 150 GB/s per peer [U], 4 x Slingshot-11 "
                                 "200G at 23 GB/s; alpha and gamma assumed [U]"),
}


def _check(p: int, g: int, n: float) -> int:
    if g < 1 or p < g or p % g:
        raise ValueError(f"world size p={p} must be a positive multiple of ranks per node g={g}")
    if n < 0:
        raise ValueError(f"size must be >= 0 bytes, got {n}")
    return p // g


def allreduce_time(m: Machine, algorithm: str, p: int, n: float, g: int | None = None,
                   rails: int | None = None) -> float:
    """Predicted seconds of one Allreduce of ``n`` bytes over ``p`` ranks (``g`` per node, ``rails`` NICs)."""
    g = m.gpus_per_node if g is None else g
    rails = m.rails if rails is None else rails
    nodes = _check(p, g, n)
    share = max(1.0, g / rails)
    a_e, b_e = (m.alpha_inter, m.beta_inter) if nodes > 1 else (m.alpha_intra, m.beta_intra)
    red = (p - 1) / p * n * m.gamma
    if algorithm == "ring":
        return 2 * (p - 1) * (a_e + n / p * b_e) + red
    if algorithm == "ring_all_rails":
        return 2 * (p - 1) * (a_e + n / p * b_e / (min(rails, g) if nodes > 1 else 1)) + red
    if algorithm == "direct":
        k = max(1, min(m.window, p - 1))
        return (2 * math.ceil((p - 1) / k) * a_e + max(2 * (p - g) / p * n * m.beta_inter * share,
                                                       2 * (g - 1) / p * n * m.beta_intra) + red)
    if algorithm == "two_level":
        c = max(1, min(m.depth, int(n / g) // MIN_CHUNK_BYTES))  # the implementation's chunking rule
        chunk = n / c
        rs = (g - 1) * (m.alpha_intra + chunk / g * (m.beta_intra + m.gamma))
        inter = (2 * (nodes - 1) * (m.alpha_inter + chunk / (g * nodes) * m.beta_inter * share)
                 + (nodes - 1) / nodes * chunk / g * m.gamma) if nodes > 1 else 0.0
        ag = (g - 1) * (m.alpha_intra + n / g * m.beta_intra)
        return (n * m.beta_intra if m.copy_in else 0.0) + rs + inter + (c - 1) * max(rs, inter) + ag
    raise ValueError(f"algorithm must be one of {ALLREDUCE}, got {algorithm!r}")


def alltoall_time(m: Machine, algorithm: str, p: int, n: float, g: int | None = None,
                  rails: int | None = None) -> float:
    """Predicted seconds of one Alltoall in which every rank sends ``n`` bytes in total (``n/p`` per peer)."""
    g = m.gpus_per_node if g is None else g
    rails = m.rails if rails is None else rails
    nodes = _check(p, g, n)
    share = max(1.0, g / rails)
    b = n / p
    remote = (p - g) * b * m.beta_inter * share
    if algorithm == "pairwise":
        return (g - 1) * (m.alpha_intra + b * m.beta_intra) + (p - g) * (m.alpha_inter + b * m.beta_inter * share)
    if algorithm == "direct":
        k = max(1, min(m.window, p - 1))
        a = m.alpha_inter if nodes > 1 else m.alpha_intra
        return math.ceil((p - 1) / k) * a + max(remote, (g - 1) * b * m.beta_intra)
    if algorithm in ("push", "pull"):
        store = n * m.beta_intra if (m.copy_in or algorithm == "push") else 0.0
        gather = (p - g) * b * m.beta_intra if algorithm == "pull" else 0.0
        return 2 * m.alpha_intra + store + gather + max((nodes - 1) * m.alpha_inter + remote, g * b * m.beta_intra)
    raise ValueError(f"algorithm must be one of {ALLTOALL}, got {algorithm!r}")


def predict(m: Machine, collective: str, algorithm: str, p: int, n: float, g: int | None = None,
            rails: int | None = None) -> float:
    """Seconds for ``collective`` ("allreduce" or "alltoall"); see the module docstring for the formulas."""
    if collective == "allreduce":
        return allreduce_time(m, algorithm, p, n, g, rails)
    if collective == "alltoall":
        return alltoall_time(m, algorithm, p, n, g, rails)
    raise ValueError(f"collective must be 'allreduce' or 'alltoall', got {collective!r}")


# ------------------------------------------------------------------------------------------ calibration
@dataclass
class Sample:
    """One measured row: collective, algorithm, ranks, ranks per node, bytes, seconds."""

    collective: str
    algorithm: str
    p: int
    g: int
    n: int
    seconds: float


def load_samples(paths: Iterable[str | Path]) -> list[Sample]:
    """Rows of ``hpdl bench ... --json`` files that the model covers (correct, non-empty, modelled algorithm)."""
    out = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        meta = data["meta"]
        p = int(meta["world_size"])
        g = int(meta.get("ranks_per_node") or p)
        coll = meta["collective"]
        known = ALLREDUCE if coll == "allreduce" else ALLTOALL if coll == "alltoall" else ()
        for r in data["rows"]:
            if r["wrong"] == 0 and r["size"] > 0 and r["resolved"] in known:
                out.append(Sample(coll, r["resolved"], p, g, int(r["size"]), r["avg_us"] * 1e-6))
    return out


def calibrate(samples: Sequence[Sample], base: Machine | None = None) -> Machine:
    """Fit alpha/beta (intra, inter) and gamma to ``samples`` by least squares on log(time) (scipy).

    Ranks per node and rails come from the samples (an emulated node: every local rank has its own "rail").

    Raises:
        ValueError: fewer samples than parameters.
    """
    import numpy as np
    from scipy.optimize import least_squares

    if len(samples) < len(FIT):
        raise ValueError(f"need at least {len(FIT)} measured rows to calibrate, got {len(samples)}")
    g = samples[0].g
    base = base or Machine("cpu-calibrated", g, g, 1e-5, 1e-9, 1e-4, 1e-9, 1e-9, copy_in=True)
    base = replace(base, gpus_per_node=g, rails=g)

    def machine(x) -> Machine:
        return replace(base, **{k: float(math.exp(v)) for k, v in zip(FIT, x)})

    def residuals(x):
        m = machine(x)
        return [math.log(max(predict(m, s.collective, s.algorithm, s.p, s.n, s.g, s.g), 1e-12) / s.seconds)
                for s in samples]

    x0 = np.log([getattr(base, k) for k in FIT])
    fit = least_squares(residuals, x0, bounds=(x0 - 12, x0 + 12), loss="soft_l1")
    return replace(machine(fit.x), source=f"least squares on {len(samples)} measured rows (log time, soft L1)")


# ------------------------------------------------------------------------------------------ tables
def compare_table(m: Machine, samples: Sequence[Sample]) -> list[dict]:
    """Measured vs model for every sample (the part we can check)."""
    rows = []
    for s in samples:
        pred = predict(m, s.collective, s.algorithm, s.p, s.n, s.g, s.g)
        rows.append({"collective": s.collective, "algorithm": s.algorithm, "p": s.p, "g": s.g, "bytes": s.n,
                     "measured_us": s.seconds * 1e6, "model_us": pred * 1e6,
                     "error_pct": 100 * (pred - s.seconds) / s.seconds})
    return rows


def win_range(m: Machine, collective: str, fast: str, slow: str, p: int, g: int | None = None,
              rails: int | None = None, lo: int = 1 << 10, hi: int = 1 << 32) -> tuple[int, int] | None:
    """``(first, last)`` power-of-two sizes in [lo, hi] where ``fast`` is predicted faster than ``slow``
    (the crossover points; the range is reported as a whole even if it has holes), None if it never is."""
    sizes = [1 << k for k in range(lo.bit_length() - 1, hi.bit_length())]
    wins = [n for n in sizes
            if predict(m, collective, fast, p, n, g, rails) < predict(m, collective, slow, p, n, g, rails)]
    return (wins[0], wins[-1]) if wins else None


def speedup_table(m: Machine, sizes: Sequence[int], worlds: Sequence[int], configs: Sequence[tuple[int, int]]):
    """PREDICTION: two_level speed-up over ring (1 rail) and ring (all rails) per (world, g, rails, size)."""
    rows = []
    for p in worlds:
        for g, rails in configs:
            if p % g:
                continue
            for n in sizes:
                tl = allreduce_time(m, "two_level", p, n, g, rails)
                rows.append({"p": p, "g": g, "rails": rails, "bytes": n, "two_level_us": tl * 1e6,
                             "vs_ring_1_rail": allreduce_time(m, "ring", p, n, g, rails) / tl,
                             "vs_ring_all_rails": allreduce_time(m, "ring_all_rails", p, n, g, rails) / tl})
    return rows


def predict_table(m: Machine, worlds: Sequence[int]) -> list[dict]:
    """PREDICTION: size ranges (1 KiB..4 GiB) where two_level beats the rings and push beats pairwise."""
    rows = []
    g = m.gpus_per_node

    def rng(collective, fast, slow, p):
        r = win_range(m, collective, fast, slow, p)
        return "never" if r is None else f"{fmt_bytes(r[0])} .. {fmt_bytes(r[1])}"

    for p in worlds:
        if p % g or p < 2:
            continue
        rows.append({"p": p, "g": g, "rails": m.rails,
                     "two_level_beats_ring_1_rail": rng("allreduce", "two_level", "ring", p),
                     "two_level_beats_ring_all_rails": rng("allreduce", "two_level", "ring_all_rails", p),
                     "push_beats_pairwise": rng("alltoall", "push", "pairwise", p),
                     "push_speedup_4MiB": (alltoall_time(m, "pairwise", p, 4 << 20)
                                           / alltoall_time(m, "push", p, 4 << 20))})
    return rows


def fmt_bytes(n) -> str:
    """``1 GiB``, ``4 MiB``, ``12 B``; ``never`` for None (a crossover that does not happen)."""
    if n is None:
        return "never"
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):g} {unit}"
    return f"{n} B"
