"""The driver's view of its trials: one run (an attempt of a configuration) or a fused group of them, and
the queue that holds them: ``pending`` (asked, waiting for a device) and ``running`` (started on a worker).

The queue is the state that :class:`hpdl.hpo.asking.Asker` (adds pending trials),
:class:`hpdl.hpo.placement.Placement` (starts, moves, re-queues them) and
:class:`hpdl.hpo.faults.FaultHandler` (ends them) share; each gets it explicitly. Not thread-safe: the
driver's loop is one thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hpdl.hpo.policies import TrialDemand


@dataclass
class TrialRun:
    """One trial as the driver tracks it. ``number``/``trial_id``: Optuna's; ``lineage``: the configuration
    (its first trial's number); ``skey``: the workload's structural key (profiles are per structure);
    ``since``: monotonic time it became pending; ``device_id``/``worker``: where it runs (empty/None while
    pending); ``demand``: what placement planned for it; ``preempt_at``: monotonic time a preempt was asked
    (0: none); ``priority``: 1.0 when ``pack_hetero`` found it promising; ``attempt``: failed attempts of
    its configuration before this one (user attribute ``hpdl_attempt``)."""

    number: int
    trial_id: int
    lineage: int
    params: dict
    skey: str
    since: float
    device_id: str = ""
    worker: Any = None
    demand: TrialDemand | None = None
    preempt_at: float = 0.0
    priority: float = 0.0
    attempt: int = 0


@dataclass
class FusedGroup(TrialRun):
    """A fused group (:mod:`hpdl.hpo.grouping`) placed and run like one trial: ``number``, ``trial_id``,
    ``lineage``, ``params`` and ``attempt`` are its first trial's, ``skey`` the group's profile key;
    ``members`` the trials still training in it (each leaves with its own outcome)."""

    members: list = field(default_factory=list)
    oom_seen: bool = False


def members(t: TrialRun) -> list[TrialRun]:
    """The trials ``t`` stands for: a group's members, or ``t`` itself."""
    return list(t.members) if isinstance(t, FusedGroup) else [t]


class TrialQueue:
    """``pending``: trials in asking order (a re-queued one first); ``running``: trial (or group) number ->
    the trial, from its start until its outcome, death or re-queue."""

    def __init__(self):
        self.pending: list[TrialRun] = []
        self.running: dict[int, TrialRun] = {}

    def requeue(self, t: TrialRun) -> None:
        """Put ``t`` (stopped, or never started) at the front of the pending queue, on no device; a group's
        trials go back one by one (groups are formed again at placement)."""
        if self.running.get(t.number) is t:
            self.running.pop(t.number)
        for m in reversed(members(t)):
            m.since, m.device_id, m.worker, m.preempt_at = time.monotonic(), "", None, 0.0
            self.pending.insert(0, m)
