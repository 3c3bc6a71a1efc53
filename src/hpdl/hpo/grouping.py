"""Driver side of fusion (:mod:`hpdl.hpo.fusion`): which pending trials form a fused group, and what a group
of K trials needs (memory, compute share, run time) before and after it was profiled. Pure bookkeeping, no
torch.

A group is formed from the trials the sampler asked (in asking order) whose ``Workload.fusion_key`` is equal,
up to ``max_trials`` at a time and no more than fit on the largest device. A group smaller than
``max_trials`` is held back while the sampler is still asking in this tick and its oldest trial waited less
than ``wait_s`` (the next asks may complete it); a lone trial runs unfused. The placement policy then sees a
group as one trial (one :class:`hpdl.hpo.policies.TrialDemand`) and places it like one.

Profiles: a group of K is profiled in place like a trial (structural key ``fused<K>|<structure>``); before
that its demand is scaled from the nearest profiled group size of the same structure, or from the profile of
one trial of it (:func:`scale_profile`), else from the static bound (:func:`hpdl.hpo.fusion.fused_memory`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hpdl.hpo.errors import HpoConfigError


@dataclass(frozen=True)
class FuseOptions:
    """The study file's ``fuse`` key.

    Attributes:
        max_trials: most trials in one fused model (>= 2).
        wait_s: seconds a group smaller than ``max_trials`` may wait for the sampler's next asks (>= 0).
        same_shape_asks: ask in batches of ``max_trials`` configurations of one shape: after a new configuration,
            the next ``max_trials - 1`` asks get its parameters outside ``fuse_vary`` fixed
            (``study.enqueue_trial`` with those, the sampler choosing the rest), so a space of many shapes still
            forms full groups. Changes what is sampled (shapes come in batches); off by default.
    """

    max_trials: int = 16
    wait_s: float = 0.5
    same_shape_asks: bool = False

    @classmethod
    def parse(cls, value: Any) -> "FuseOptions | None":
        """``false``/``null`` -> None (no fusion); ``true`` -> the defaults; a mapping -> its options.

        Raises:
            HpoConfigError: another type, an unknown key, or an option out of range (named).
        """
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, dict):
            raise HpoConfigError(f"fuse={value!r}, expected false, true or {{max_trials: N, wait_s: S, "
                                 "same_shape_asks: B}")
        allowed = {"max_trials", "wait_s", "same_shape_asks"}
        if set(value) - allowed:
            raise HpoConfigError(f"fuse has unknown keys {sorted(set(value) - allowed)}; allowed: {sorted(allowed)}")
        k = value.get("max_trials", cls.max_trials)
        if type(k) is not int or k < 2:
            raise HpoConfigError(f"fuse max_trials={k!r}, expected an int >= 2")
        w = value.get("wait_s", cls.wait_s)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
            raise HpoConfigError(f"fuse wait_s={w!r}, expected seconds >= 0")
        same = value.get("same_shape_asks", False)
        if type(same) is not bool:
            raise HpoConfigError(f"fuse same_shape_asks={same!r}, expected true or false (unquoted)")
        return cls(k, float(w), same)


def group_skey(structural_key: str, k: int) -> str:
    """Profile key of a fused group of ``k`` trials of one structure."""
    return f"fused{k}|{structural_key}"


def parse_group_skey(skey: str) -> tuple[int, str]:
    """``(k, structural key)`` of a group key; ``(1, skey)`` for a lone trial's key."""
    head, sep, rest = skey.partition("|")
    if sep and head.startswith("fused") and head[5:].isdigit():
        return int(head[5:]), rest
    return 1, skey


def form_groups(pending: Sequence[Any], key_of: Callable[[Any], str], max_trials: int, wait_s: float,
                filling: bool, now: float, limit: Callable[[Any], int] | None = None) -> list[list[Any]]:
    """Fused groups out of ``pending`` trials (each with ``since``, the time it became pending).

    Trials with equal ``key_of(t)`` are taken in order, ``max_trials`` at a time (``limit(t)``: a smaller
    bound for that key, e.g. what fits in memory); the last, smaller group of a key is returned only if the
    sampler is not ``filling`` or its oldest trial waited ``wait_s``. Groups of one trial are returned too
    (they run unfused). Returns the groups in the order of their first trial.
    """
    buckets: dict[str, list[Any]] = {}
    for t in pending:
        buckets.setdefault(key_of(t), []).append(t)
    out = []
    for ts in buckets.values():
        cap = max(1, min(max_trials, limit(ts[0]) if limit is not None else max_trials))
        for i in range(0, len(ts), cap):
            chunk = ts[i:i + cap]
            if len(chunk) < cap and filling and now - min(t.since for t in chunk) < wait_s:
                continue
            out.append(chunk)
    out.sort(key=lambda g: pending.index(g[0]))
    return out


def scale_profile(memory_bytes: int, step_time_s: float, compute: float, k_from: int, k_to: int,
                  context_bytes: int) -> tuple[int, float, float]:
    """(memory bytes, step time s, compute share) of ``k_to`` fused trials from a profile of ``k_from``.

    Model (an estimate until the group is profiled): the context is paid once and the rest of the memory
    grows with K; the host time of a step (kernel launches) does not grow with K, the GPU time of a step
    does, linearly (an upper bound: fused kernels are wider, not longer per trial).
    """
    r = k_to / max(1, k_from)
    mem = int(context_bytes + max(0, memory_bytes - context_bytes) * r)
    if not (step_time_s > 0 and compute > 0) or math.isnan(step_time_s) or math.isnan(compute):
        return mem, step_time_s, compute
    gpu = compute * step_time_s
    host = step_time_s if compute < 1.0 else 0.0
    gpu_to = gpu * r
    step = max(host, gpu_to, 1e-9)
    return mem, step, min(1.0, gpu_to / step)


def largest_group(single_bytes: int, device_bytes: int, context_bytes: int) -> int:
    """Most trials of one planned size (bytes, context included) a fused group may hold on a device."""
    per = max(1, single_bytes - context_bytes)
    return max(1, (device_bytes - context_bytes) // per)
