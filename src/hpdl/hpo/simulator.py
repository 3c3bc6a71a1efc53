"""Event-driven simulation of a study on a GPU pool we cannot run (e.g. 12 A100 + 4 H100). SIMULATION.

Each trial is replayed from its profiled costs (:class:`SimTrial`): host time per step ``cpu_s``, GPU time
per step on a speed-1 GPU ``gpu_s``, peak memory, steps and final metric. On a device of speed ``s``:

    step_time = max(cpu_s, gpu_s / s)        busy = (gpu_s / s) / step_time

and co-located processes time-slice, so a running trial advances at ``1 / (step_time * max(1, sum busy))``
steps per second. Under MPS (``mps=True``) the kernels of co-located processes run side by side, modelled as
a GPU that serves a summed busy fraction of ``mps_capacity`` before anyone slows down:
``1 / (step_time * max(1, sum busy / mps_capacity))``; the capacity is fitted to measured MPS runs. A trial first spends ``startup_s`` (model build and warm-up in a reused worker process) holding its
memory; if the true memory on the device then exceeds its capacity the newest trial fails with an
out-of-memory error at the end of its start-up and is retried later. Until one trial of a configuration
has started, the scheduler sees its static memory bound and no compute share (as the real driver does).
The same :mod:`hpdl.hpo.policies` policy objects as the driver make every placement.

Fusion (``fuse=K``, :mod:`hpdl.hpo.fusion`): trials of one structure (``skey``) are fused K at a time, in
sampling order, into one trial of the simulation (:func:`fuse_trials`): the host time of a step stays (one
set of kernel launches drives K trials), the GPU time of a step grows K-fold (an upper bound: a fused kernel
is wider, not longer per trial), memory is one context plus K times the rest. Groups are formed from the
whole trace at once (the driver forms them from what the sampler asked; with a lookahead as large as the
budget, as in the fusion benchmark, that is the same).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Sequence

from hpdl.hpo.errors import HpoConfigError
from hpdl.hpo.policies import GIB, SMALL_BYTES, Device, DeviceState, SchedulingPolicy, TrialDemand, get_policy

# Bounds of a replay, so that every argument value ends in a result or an error within seconds to minutes
MAX_SIM_DEVICES = 4096       # simulated devices in a pool
MAX_SIM_TRIALS = 4096        # trials in one replay (6400 took 50 s for four policies on a 2-core CPU)
MAX_OVERHEAD = 10.0          # slowdown per extra co-located trial
MAX_STARTUP_S = 86_400.0     # dispatch time of a trial, s


@dataclass
class SimTrial:
    """Profiled cost of one trial. Times in seconds, memory in bytes; ``skey`` groups configurations with
    the same structure (one profile serves them all); ``static_memory_bytes`` is the pre-profile bound;
    ``flops`` the static FLOPs per step (0 = unknown), which ``pack`` uses to guess an unprofiled share."""

    key: int
    cpu_s: float
    gpu_s: float
    memory_bytes: int
    steps: int
    value: float = 0.0
    skey: str = ""
    static_memory_bytes: int = 0
    flops: float = 0.0


@dataclass
class SimResult:
    """Makespan (s), OOM failures, per-trial finish times and best-so-far ``history`` [(t, best)]."""

    policy: str
    makespan_s: float
    oom: int
    finished: int
    history: list[tuple[float, float]] = field(default_factory=list)
    max_colocated: int = 0


def pool_from_spec(spec: str, memory_gb: dict[str, float] | None = None,
                   speed: dict[str, float] | None = None) -> list[Device]:
    """``"12xA100,4xH100"`` -> devices. Defaults: A100 80 GiB speed 0.5, H100 80 GiB speed 1.0,
    H200 141 GiB speed 1.0 (speed of compute-bound work relative to H100; an assumption, documented).

    Raises:
        HpoConfigError: malformed spec or unknown kind without ``memory_gb``/``speed`` entries.
    """
    mem = {"A100": 80.0, "H100": 80.0, "H200": 141.0, **(memory_gb or {})}
    spd = {"A100": 0.5, "H100": 1.0, "H200": 1.0, **(speed or {})}
    devices = []
    for part in spec.split(","):
        n, _, kind = part.strip().partition("x")
        if not n.isdigit() or kind not in mem or kind not in spd:
            raise HpoConfigError(f"pool spec part {part!r}: expected '<count>x<kind>' with kind in {sorted(mem)}")
        # 0 devices left the replay waiting forever for a device to place on
        if not 1 <= int(n) <= MAX_SIM_DEVICES:
            raise HpoConfigError(f"pool spec part {part!r}: count {int(n)}, expected 1..{MAX_SIM_DEVICES} devices")
        if len(devices) + int(n) > MAX_SIM_DEVICES:
            raise HpoConfigError(f"pool spec {spec!r}: more than {MAX_SIM_DEVICES} devices in all")
        for _ in range(int(n)):
            devices.append(Device(f"{kind}-{len(devices)}", kind, int(mem[kind] * GIB), spd[kind]))
    return devices


def fuse_trials(trials: Sequence[SimTrial], k: int, direction: str = "maximize",
                context_bytes: int = 600 << 20, device_bytes: int = 0) -> list[SimTrial]:
    """``trials`` fused ``k`` at a time per structure (module docstring); a group's key is its first trial's,
    its value the best of its trials (they finish together), its steps the most of them. With
    ``device_bytes`` > 0 (the largest device's memory), a group also holds no more trials than fit in it
    (profiled and static bound), as the driver caps groups (:func:`hpdl.hpo.grouping.largest_group`).

    Raises:
        HpoConfigError: ``k < 1``.
    """
    if k < 1:
        raise HpoConfigError(f"fuse={k}, expected an int >= 1 (1: no fusion)")

    def fits(g: list[SimTrial], t: SimTrial) -> bool:
        if device_bytes <= 0:
            return True
        n = len(g) + 1
        for attr in ("memory_bytes", "static_memory_bytes"):
            per = max(0, max(getattr(x, attr) for x in (*g, t)) - context_bytes)
            if context_bytes + n * per > device_bytes:
                return False
        return True

    groups: list[list[SimTrial]] = []
    open_: dict[str, list[SimTrial]] = {}
    for t in trials:
        sk = t.skey or f"#{t.key}"
        g = open_.get(sk)
        if g is None or len(g) >= k or not fits(g, t):
            g = open_[sk] = []
            groups.append(g)
        g.append(t)
    best = max if direction == "maximize" else min
    out = []
    for g in groups:
        n, one = len(g), g[0]
        mem = max(t.memory_bytes for t in g)
        stat = max(t.static_memory_bytes for t in g)
        out.append(SimTrial(one.key, max(t.cpu_s for t in g), sum(t.gpu_s for t in g),
                            int(context_bytes + n * max(0, mem - context_bytes)), max(t.steps for t in g),
                            best(t.value for t in g), f"fused{n}|{one.skey}" if one.skey else "",
                            int(context_bytes + n * max(0, stat - context_bytes)) if stat else 0,
                            sum(t.flops for t in g)))
    return out


def simulate(trials: Sequence[SimTrial], devices: Sequence[Device], policy: str | SchedulingPolicy,
             startup_s: float = 1.0, max_retries: int = 2, lookahead: int = 0, direction: str = "maximize",
             overhead: float = 0.0, mps: bool = False, mps_capacity: float = 2.0, fuse: int = 1,
             **policy_kwargs) -> SimResult:
    """Replay ``trials`` (in sampling order) on ``devices`` under ``policy``; see the module docstring.
    ``fuse``: trials per fused model (1: none; :func:`fuse_trials`); ``finished`` still counts trials.

    ``overhead`` is a co-location cost calibrated on measured runs: with ``n`` trials running on a GPU each
    advances ``1 + overhead * (n - 1)`` times slower on top of time-slicing (context switches, host
    contention). 0 is the ideal time-slicing model. ``mps`` switches to the MPS model (module docstring) and
    tells a policy that has an ``mps`` attribute (``pack``) that MPS is on.

    Returns:
        SimResult. Raises AssertionError if a policy that respects memory over-fills a device's
        profiled memory, or a trial does not reach exactly one terminal state.
    """
    # every number is checked: nan, inf or a huge start-up/overhead made simulated time stop advancing (a hang)
    if not devices:
        raise HpoConfigError("devices: the simulated pool is empty, expected at least one device")
    if not 0 < mps_capacity < math.inf:
        raise HpoConfigError(f"mps_capacity={mps_capacity}, expected a finite number > 0")
    if not 0 <= overhead <= MAX_OVERHEAD:
        raise HpoConfigError(f"overhead={overhead}, expected 0 <= overhead <= {MAX_OVERHEAD:g} (slowdown per extra "
                             "co-located trial)")
    if not 0 <= startup_s <= MAX_STARTUP_S:
        raise HpoConfigError(f"startup_s={startup_s}, expected 0 <= startup_s <= {MAX_STARTUP_S:g} seconds")
    if len(trials) > MAX_SIM_TRIALS:
        raise HpoConfigError(f"trials: {len(trials)} trials, expected at most {MAX_SIM_TRIALS}")
    if fuse != 1:
        groups = fuse_trials(trials, fuse, direction, device_bytes=max(d.memory_bytes for d in devices))
        res = simulate(groups, devices, policy, startup_s, max_retries, lookahead, direction, overhead, mps,
                       mps_capacity, 1, **policy_kwargs)
        res.finished = len(trials)  # simulate asserts that every group (so every trial) finished
        return res
    pol = get_policy(policy, **policy_kwargs)
    if mps and hasattr(pol, "mps"):
        pol.mps = True
    capacity = mps_capacity if mps else 1.0
    queue = list(trials)
    by_key = {t.key: t for t in trials}
    attempts = {t.key: 0 for t in trials}
    profiled: set[str] = set()
    look = lookahead or max(2, min(32, pol.max_concurrency())) * len(devices)  # as the driver samples ahead
    pending: list[tuple[SimTrial, float]] = []
    run: dict[str, list[dict]] = {d.id: [] for d in devices}
    dev_by_id = {d.id: d for d in devices}
    now, oom, done, history, max_co = 0.0, 0, set(), [], 0
    best = None

    def step_time(t: SimTrial, d: Device) -> tuple[float, float]:
        g = t.gpu_s / d.speed
        st = max(t.cpu_s, g, 1e-9)
        return st, g / st

    while queue or pending or any(run.values()):
        placed = True
        while placed:  # sample and place until the policy starts nothing more at this instant
            while queue and len(pending) < look:
                pending.append((queue.pop(0), now))
            demands = []
            for t, since in pending:
                known = (t.skey or t.key) in profiled
                st, busy = step_time(t, devices[0])
                mem = t.memory_bytes if known else (t.static_memory_bytes or t.memory_bytes)
                # as the driver: an unprofiled trial's run time is unknown (the policy may estimate it)
                demands.append(TrialDemand(t.key, mem, busy if known else 1.0, t.steps * (st if known else 0.01),
                                           waited_s=now - since, profiled=known, flops=t.flops, steps=t.steps))
            states = [DeviceState(d, [r["demand"] for r in run[d.id]]) for d in devices]
            assignments = pol.place(demands, states)
            placed = bool(assignments)
            for a in assignments:
                idx = next(i for i, (t, _) in enumerate(pending) if t.key == a.key)
                t, _ = pending.pop(idx)
                dem = next(x for x in demands if x.key == a.key)
                d = dev_by_id[a.device_id]
                run[d.id].append({"t": t, "demand": dem, "left": float(t.steps), "ready": now + startup_s})
                max_co = max(max_co, len(run[d.id]))
        # Next event: a start-up ends, or a running trial finishes at the current rates.
        nxt, rates = math.inf, {}
        for did, rs in run.items():
            d = dev_by_id[did]
            load = sum(step_time(r["t"], d)[1] for r in rs if r["ready"] <= now)
            slow = 1.0 + overhead * max(0, sum(r["ready"] <= now for r in rs) - 1)
            for r in rs:
                if r["ready"] > now:
                    nxt = min(nxt, r["ready"])
                else:
                    rate = 1.0 / (step_time(r["t"], d)[0] * max(1.0, load / capacity) * slow)
                    rates[id(r)] = rate
                    nxt = min(nxt, now + r["left"] / rate)
        if nxt is math.inf:
            if pending and not any(run.values()):
                raise HpoConfigError(f"trial {pending[0][0].key} fits on no device of the pool")
            continue
        dt = nxt - now
        now = nxt
        for did, rs in run.items():
            d = dev_by_id[did]
            for r in list(rs):
                if id(r) in rates:
                    r["left"] -= rates[id(r)] * dt
                if r["ready"] <= now + 1e-12 and r.get("started") is None:
                    r["started"] = now
                    first = (r["t"].skey or r["t"].key) not in profiled
                    profiled.add(r["t"].skey or r["t"].key)
                    st, busy = step_time(r["t"], devices[0])  # its profile replaces the static demand
                    if first and hasattr(pol, "observe"):  # as the driver: one profile per structure
                        stat = r["t"].static_memory_bytes
                        pol.observe(busy, r["t"].flops, r["t"].memory_bytes / stat if stat > SMALL_BYTES else 0.0, st)
                    r["demand"] = TrialDemand(r["t"].key, r["t"].memory_bytes, busy, r["t"].steps * st, profiled=True,
                                              flops=r["t"].flops, steps=r["t"].steps)
                    if sum(x["t"].memory_bytes for x in rs) > d.memory_bytes:  # out of memory: newest fails
                        rs.remove(r)
                        oom += 1
                        attempts[r["t"].key] += 1
                        if attempts[r["t"].key] <= max_retries:
                            queue.append(r["t"])
                        else:
                            done.add(r["t"].key)
                        continue
                if r["left"] <= 1e-9 and id(r) in rates:
                    rs.remove(r)
                    assert r["t"].key not in done, f"trial {r['t'].key} finished twice"
                    done.add(r["t"].key)
                    v = r["t"].value
                    if best is None or (v > best if direction == "maximize" else v < best):
                        best = v
                        history.append((now, v))
    assert done == set(by_key), "every trial must reach exactly one terminal state"
    return SimResult(pol.name, now, oom, len(done), history, max_co)


def resample(trials: Sequence[SimTrial], n: int, seed: int = 0) -> list[SimTrial]:
    """``n`` trials drawn with replacement (seeded) from ``trials``, keyed 0..n-1 in draw order.

    Raises:
        HpoConfigError: ``n < 1`` or no trials to draw from.
    """
    if not 1 <= n <= MAX_SIM_TRIALS or not trials:
        raise HpoConfigError(f"resample: n={n} from {len(trials)} trials, expected 1 <= n <= {MAX_SIM_TRIALS} and a "
                             "non-empty trace")
    rng = random.Random(seed)
    return [SimTrial(**{**rng.choice(list(trials)).__dict__, "key": k}) for k in range(n)]


def synthetic_trials(n: int = 64, seed: int = 0) -> list[SimTrial]:
    """A stand-in trace when no profiled trace is given (labelled as such): 70 % light launch-bound trials
    (busy ~0.1, < 2 GiB), 20 % medium, 10 % heavy (busy ~0.9, 20-60 GiB)."""
    rng = random.Random(seed)
    classes = []  # 12 structures; configurations of one structure share a profile
    for c in range(12):
        u = c / 12
        if u < 0.7:
            classes.append((0.010, rng.uniform(0.0005, 0.002), rng.uniform(0.8, 2.0)))
        elif u < 0.9:
            classes.append((0.010, rng.uniform(0.004, 0.01), rng.uniform(2, 12)))
        else:
            classes.append((0.010, rng.uniform(0.05, 0.12), rng.uniform(20, 60)))
    out = []
    for k in range(n):
        c = rng.randrange(12)
        cpu, gpu, mem = classes[c]
        out.append(SimTrial(k, cpu, gpu, int(mem * GIB), 200, rng.random(), f"s{c}", int(mem * 1.3 * GIB)))
    return out


def load_trials(path: str) -> list[SimTrial]:
    """Trials from a JSON list of :class:`SimTrial` fields (as written by benchmarks/hpo_device.py)."""
    with open(path) as f:
        rows = json.load(f)
    return [SimTrial(**{k: r[k] for k in SimTrial.__dataclass_fields__ if k in r}) for r in rows]
