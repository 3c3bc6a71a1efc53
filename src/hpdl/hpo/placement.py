"""Placement, the driver's first job after sampling: what each pending trial needs (a measured profile or a
meta-device estimate), which device states the policy sees, and starting, moving and re-queueing trials.
Mixed into :class:`hpdl.hpo.driver.Driver`, whose state (``pending``, ``running``, ``profiles``, ``policy``,
``launcher``, ``ledger``) these methods use; nothing here reads or writes a trial's state in the store
except the asks and the Ray GPU fraction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from hpdl.hpo import protocol
from hpdl.hpo.launch import WARM_MAX, send
from hpdl.hpo.profiler import CONTEXT_BYTES, TrialProfile, static_profile
from hpdl.hpo.scheduler import DeviceState, TrialDemand

_ESTIMATE_BUDGET_S = 0.05  # static estimates per loop tick: dispatch what is known instead of waiting for all
_SAMPLE_BUDGET_S = 0.05  # asks per loop tick after the first (each is ~6 storage commits): start early
_BUDGET_READ_S = 0.05  # when the budget limits the asks, count from a storage read at most this old


@dataclass
class _Trial:
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
    attempt: int = 0  # failed attempts of its configuration before this one (user attribute hpdl_attempt)


class PlacementMixin:
    """Demands, sampling, placement, starts, preemption and migration of :class:`hpdl.hpo.driver.Driver`."""

    def _demand(self, t: _Trial, kinds: set[str]) -> TrialDemand:
        measured = [p for k in kinds if (p := self.profiles.get(t.skey, k)) is not None and p.measured]
        steps = self.workload.schedule(self.workload.resolve({**self.spec.fixed, **t.params}))[0]
        if not self.policy.uses_profiles:  # the baselines place blind: no static trace on their critical path
            return TrialDemand(t.number, 0, 1.0, float(steps) * 0.01, t.priority,
                               waited_s=time.monotonic() - t.since, profiled=False)
        if measured:
            ref = max(measured, key=lambda q: q.step_time_s)
            mem = max(q.memory_bytes for q in measured)
            return TrialDemand(t.number, mem, ref.compute, steps * ref.step_time_s, t.priority,
                               waited_s=time.monotonic() - t.since, profiled=True, steps=steps)
        static = self._static(t, next(iter(kinds)) if kinds else "cpu")
        return TrialDemand(t.number, static.memory_bytes, 1.0, float(steps) * 0.01, t.priority,
                           waited_s=time.monotonic() - t.since, profiled=False, flops=static.flops, steps=steps)

    def _static(self, t: _Trial, kind: str) -> TrialProfile:
        st = self.profiles.get(t.skey, "static")
        if st is None:
            st = static_profile(self.workload, {**self.spec.fixed, **t.params}, "static",
                                CONTEXT_BYTES if self._cuda else 0)
            self.profiles.put(t.skey, st)
        return st

    def _device_states(self, devices) -> list[DeviceState]:
        states = {d.id: DeviceState(d) for d in devices}
        for t in self.running.values():
            if t.device_id in states and t.demand is not None:
                states[t.device_id].running.append(t.demand)
        for w in self.workers:  # an idle worker still holds its CUDA context
            if w.trial is None and w.device_id in states and states[w.device_id].device.torch_device != "cpu":
                states[w.device_id].running.append(TrialDemand(-1 - id(w) % 10**9, CONTEXT_BYTES, 0.0, 0.0,
                                                               profiled=True))
        return list(states.values())

    def _task(self, t: _Trial, device) -> protocol.Task:
        need_profile = self.policy.uses_profiles and (not (p := self.profiles.get(t.skey, device.kind))
                                                      or not p.measured)
        return protocol.Task(
            t.trial_id, t.number, t.lineage, t.params, device_id=device.id, host=self.host,
            study_uid=self._spec_dict["study_uid"], checkpoint_dir=self._spec_dict["checkpoint_dir"],
            profile=need_profile, static=self._static(t, device.kind).__dict__ if need_profile else None,
            context_bytes=CONTEXT_BYTES if device.torch_device.startswith("cuda") else 0,
            memory_cap=self.policy.memory_cap(t.demand, device) if t.demand is not None else None)

    def _start(self, t: _Trial, device, sm_percent: int) -> None:
        """Start ``t`` on ``device``: a warm local worker, or a Ray task with ``num_gpus`` from the policy."""
        frac = self.policy.gpu_fraction(t.demand, device)
        w = self.launcher.start(device, self._task(t, device), sm_percent, frac)
        w.trial, t.worker, t.device_id = t, w, device.id  # the worker records host, pid and start time
        self.running[t.number] = t
        if self.backend is not None:
            self.storage.set_trial_user_attr(t.trial_id, "hpdl_gpu_fraction", frac)

    def _sample(self, finished: set[int], active: set[int]) -> None:
        """Ask the sampler for trials until the lookahead is full: enough to fill every device up to the
        policy's concurrency (packing looks ahead). Stop after ``_SAMPLE_BUDGET_S`` (one ask at least) and
        go on in the next tick, so the first trials start without waiting for the whole lookahead (30
        asks took about 0.5 s before the first trial started on an H200 host, 2026-11-30)."""
        self._short = False
        want = self.spec.lookahead or max(2, min(WARM_MAX, self.policy.max_concurrency())) * max(
            1, len(self.pool.devices()))
        if len(self.pending) >= want:
            return
        budget = 0 if self.ledger.stop_requested else self.spec.n_trials - len(finished) - len(active)
        if budget > 0 and (self.ledger.shared or budget <= want - len(self.pending)):
            # others ask too (many nodes, resume), or the budget, not the lookahead, limits the asks: count
            # from the storage
            finished, active = self.ledger.lineages(_BUDGET_READ_S)
            budget = 0 if self.ledger.stop_requested else self.spec.n_trials - len(finished) - len(active)
        waiting = self.ledger.waiting
        deadline, asked = time.monotonic() + _SAMPLE_BUDGET_S, False
        while len(self.pending) < want and (budget > 0 or waiting > 0):
            if asked and time.monotonic() > deadline:  # one ask a tick at least
                self._short = True  # the next tick goes on sampling without waiting for a message
                return
            popped = waiting > 0  # Optuna's ask takes a waiting trial (a retry, or one a user enqueued) first
            trial = self.study.ask(self.dists)
            lin = int(trial.user_attrs.get("hpdl_lineage", trial.number))
            self.ledger.asked(lin)
            waiting -= popped
            # a new configuration uses the budget; a retry, or a trial re-queued as WAITING after an interrupt
            # (labelled when first asked, and counted active since), does not
            if "hpdl_lineage" not in trial.user_attrs:
                trial.set_user_attr("hpdl_lineage", lin)
                budget -= 1
            skey = self.workload.structural_key({**self.spec.fixed, **trial.params})
            self.pending.append(_Trial(trial.number, self.ledger.trial_id(trial.number), lin, dict(trial.params),
                                       skey, time.monotonic(), attempt=int(trial.user_attrs.get("hpdl_attempt", 0))))
            asked = True
        self._short = asked  # place what this tick sampled without waiting for a message

    def _rebind(self) -> None:
        """Move each trial still queued on a starting worker to an idle ready worker of the same device (a
        warm worker that finished a trial while the new one starts): it starts now instead of after the
        cold start. The starting worker stays, idle, for later trials."""
        for w in [w for w in self.workers if w.queued is not None and w.trial is not None]:
            spare = self.launcher.idle_ready(w)
            if spare is None:
                continue
            if not send(spare, protocol.RunTask(task=w.queued)):
                continue  # the spare just died (reaping removes it): the trial stays queued where it was
            t = w.trial
            w.trial, w.queued, w.idle_since = None, None, time.monotonic()
            spare.trial, t.worker = t, spare

    def _requeue(self, t: _Trial) -> None:
        """Put ``t`` (stopped, or never started) at the front of the pending queue, on no device."""
        self.running.pop(t.number, None)
        t.since, t.device_id, t.worker, t.preempt_at = time.monotonic(), "", None, 0.0
        self.pending.insert(0, t)

    def _preempt(self, t: _Trial) -> None:
        """Stop ``t`` with a checkpoint so it continues elsewhere; a trial still queued on a starting worker
        goes straight back to the pending queue."""
        w = t.worker
        if w is not None and w.queued is not None:
            w.trial, w.queued, w.idle_since = None, None, time.monotonic()
            self._requeue(t)
            return
        t.preempt_at = time.monotonic()
        send(w, protocol.Preempt(trial_id=t.trial_id))

    def _migrate(self, devices) -> None:
        """pack_hetero: mark running trials better than the median at their last report as promising and
        move those the policy picks to faster GPUs (preempt with a checkpoint; they are re-placed first)."""
        if not self.policy.migrates or time.monotonic() - self._last_migrate < 2.0:
            return
        self._last_migrate = time.monotonic()
        by_step: dict[int, list[float]] = {}
        for fz in self.study.get_trials(deepcopy=False):
            for step, v in fz.intermediate_values.items():
                by_step.setdefault(step, []).append(v)
        sign = 1.0 if self.spec.direction == "maximize" else -1.0
        for t in self.running.values():
            iv = self.storage.get_trial(t.trial_id).intermediate_values
            if iv and t.demand is not None:
                step = max(iv)
                peers = sorted(by_step.get(step, []))
                t.priority = float(len(peers) >= 3 and sign * (iv[step] - peers[len(peers) // 2]) > 0)
                t.demand.priority = t.priority
        for key in self.policy.migrations(self._device_states(devices)):
            t = self.running[key]
            if not t.preempt_at:
                self.migrated += 1
                self._preempt(t)

    def _elastic(self, devices) -> None:
        ids = {d.id for d in devices}
        for w in self.workers:
            if w.device_id in ids:
                continue
            t = w.trial
            if t is None:
                if not w.stopping:
                    w.stopping = True
                    send(w, protocol.Stop())
            elif not t.preempt_at:
                self._preempt(t)

    def _place(self, devices) -> None:
        """Ask the policy to place the pending trials on ``devices`` and start its assignments; a trial
        measured larger than every device fails for good (``too_big``)."""
        states = self._device_states(devices)
        by_id = {d.id: d for d in devices}
        demands = self._demands(devices)
        biggest = max(d.memory_bytes for d in devices)
        for t in [t for t in self.pending if t.number in demands and demands[t.number].profiled
                  and demands[t.number].memory_bytes > biggest]:
            self.pending.remove(t)  # measured, and larger than any device: it can never run
            need = demands.pop(t.number).memory_bytes
            self.ledger.fail(t.number, t.params, {"hpdl_lineage": t.lineage}, "too_big",
                             f"needs {need} B, largest device has {biggest} B", retry=False)
        for a in self.policy.place(list(demands.values()), states):
            t = next(x for x in self.pending if x.number == a.key)
            self.pending.remove(t)
            t.demand = demands[a.key]
            self._start(t, by_id[a.device_id], a.sm_percent)

    def _demands(self, devices) -> dict[int, TrialDemand]:
        """Demands of the pending trials, oldest first. A trial whose structure has neither a profile nor a
        static estimate yet needs a meta-device trace (about 0.1 s); after ``_ESTIMATE_BUDGET_S`` of those in
        one tick the rest wait for the next tick, so the first trials start without waiting for every
        estimate of a deep lookahead."""
        kinds = {d.kind for d in devices}
        deadline = time.monotonic() + _ESTIMATE_BUDGET_S
        out, traced = {}, 0
        for t in self.pending:
            known = (not self.policy.uses_profiles or self.profiles.get(t.skey, "static") is not None
                     or any((p := self.profiles.get(t.skey, k)) is not None and p.measured for k in kinds))
            if known or not traced or time.monotonic() < deadline:  # at least one new estimate a tick
                traced += not known
                out[t.number] = self._demand(t, kinds)
        return out

