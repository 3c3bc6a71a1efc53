"""Placement, the driver's first job after sampling: what each pending trial needs (a measured profile or a
meta-device estimate), which device states the policy sees, and starting, moving and re-queueing trials.
Mixed into :class:`hpdl.hpo.driver.Driver`, whose state (``pending``, ``running``, ``profiles``, ``policy``,
``launcher``, ``ledger``) these methods use; nothing here reads or writes a trial's state in the store
except the asks and the Ray GPU fraction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hpdl.hpo import grouping, protocol
from hpdl.hpo.launch import WARM_MAX, send
from hpdl.hpo.fusion import fused_memory
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


@dataclass
class _Group(_Trial):
    """A fused group (:mod:`hpdl.hpo.grouping`) placed and run like one trial: ``number``, ``trial_id``,
    ``lineage``, ``params`` and ``attempt`` are its first trial's, ``skey`` the group's profile key;
    ``members`` the trials still training in it (each leaves with its own outcome)."""

    members: list = field(default_factory=list)
    oom_seen: bool = False


def members(t: _Trial) -> list:
    """The trials ``t`` stands for: a group's members, or ``t`` itself."""
    return list(t.members) if isinstance(t, _Group) else [t]


class PlacementMixin:
    """Demands, sampling, placement, starts, preemption and migration of :class:`hpdl.hpo.driver.Driver`."""

    @property
    def _fuse(self) -> grouping.FuseOptions | None:
        """The study's fusion options (its ``fuse`` key), or None."""
        return grouping.FuseOptions.parse(getattr(self.spec, "fuse", None))

    def _group_profiles(self, t: _Group, kinds: set[str]) -> list[TrialProfile]:
        """Measured profiles for group ``t``: its own size's, else scaled from the nearest measured size of its
        structure (a lone trial of it counts as size 1), per device kind."""
        k, structure = grouping.parse_group_skey(t.skey)
        out = []
        for kind in kinds:
            own = self.profiles.get(t.skey, kind)
            if own is not None and own.measured:
                out.append(own)
                continue
            near = []
            for key, prof in self.profiles.items():
                pkind, _, skey = key.partition("|")
                kk, st = grouping.parse_group_skey(skey)
                if pkind == kind and st == structure and prof.measured:
                    near.append((abs(kk - k), kk, prof))
            if near:
                _, kk, prof = min(near, key=lambda x: (x[0], -x[1]))
                mem, st, comp = grouping.scale_profile(prof.memory_bytes, prof.step_time_s, prof.compute, kk, k,
                                                       CONTEXT_BYTES if self._cuda else 0)
                out.append(TrialProfile(kind, mem, st, comp, prof.flops * k / kk, prof.source))
        return out

    def _demand(self, t: _Trial, kinds: set[str]) -> TrialDemand:
        if isinstance(t, _Group) and self.policy.uses_profiles:
            measured = self._group_profiles(t, kinds)
        else:
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
        if isinstance(t, _Group):  # K times one trial's bound, with one context
            one = self._static(t.members[0], kind)
            k = len(t.members)
            return TrialProfile("static", fused_memory(one.memory_bytes, k, CONTEXT_BYTES if self._cuda else 0),
                                flops=one.flops * k, source="static")
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
            memory_cap=self.policy.memory_cap(t.demand, device) if t.demand is not None else None,
            fused=tuple(protocol.Task(m.trial_id, m.number, m.lineage, m.params, device_id=device.id, host=self.host,
                                      study_uid=self._spec_dict["study_uid"],
                                      checkpoint_dir=self._spec_dict["checkpoint_dir"]) for m in members(t))
            if isinstance(t, _Group) else ())

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
            1, len(self.pool.devices())) * (self._fuse.max_trials if self._fuse else 1)  # fusion: groups to fill
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
            shaped = not popped and budget > 0 and self._shape_ask()
            trial = self.study.ask(self.dists)
            lin = int(trial.user_attrs.get("hpdl_lineage", trial.number))
            self.ledger.asked(lin)
            waiting -= popped
            # a new configuration uses the budget; a retry, or a trial re-queued as WAITING after an interrupt
            # (labelled when first asked, and counted active since), does not
            if "hpdl_lineage" not in trial.user_attrs:
                trial.set_user_attr("hpdl_lineage", lin)
                budget -= 1
                self._shape_asked(trial.params, shaped)
            skey = self.workload.structural_key({**self.spec.fixed, **trial.params})
            self.pending.append(_Trial(trial.number, self.ledger.trial_id(trial.number), lin, dict(trial.params),
                                       skey, time.monotonic(), attempt=int(trial.user_attrs.get("hpdl_attempt", 0))))
            asked = True
        self._short = asked  # place what this tick sampled without waiting for a message

    def _shape_ask(self) -> bool:
        """``fuse: {same_shape_asks: true}``: fix the shape of the next ask to that of the last new one while
        its batch (``max_trials``) is not full: ``enqueue_trial`` with the parameters outside ``fuse_vary``, so
        the sampler (TPE, random) chooses only the others and the trials can be fused. True if it did."""
        fuse = self._fuse
        params, left = getattr(self, "_shape", (None, 0))
        if fuse is None or not fuse.same_shape_asks or not params or left <= 0:
            return False
        self.study.enqueue_trial(params, skip_if_exists=False)  # the ask below pops it
        return True

    def _shape_asked(self, params: dict, shaped: bool) -> None:
        """Count a new configuration in the current same-shape batch, or start a batch with its shape."""
        fuse = self._fuse
        if fuse is None or not fuse.same_shape_asks:
            return
        if shaped:
            self._shape = (self._shape[0], self._shape[1] - 1)
        else:
            self._shape = ({k: v for k, v in params.items() if k not in self.workload.fuse_vary},
                           fuse.max_trials - 1)

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
        """Put ``t`` (stopped, or never started) at the front of the pending queue, on no device; a group's
        trials go back one by one (groups are formed again at placement)."""
        if self.running.get(t.number) is t:
            self.running.pop(t.number)
        for m in reversed(members(t)):
            m.since, m.device_id, m.worker, m.preempt_at = time.monotonic(), "", None, 0.0
            self.pending.insert(0, m)

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
        units = {t.number: t for t in self.pending if t.number in demands}
        if self._fuse is not None:
            units, demands = self._fused_units(units, demands, devices)
        for a in self.policy.place(list(demands.values()), states):
            t = units[a.key]
            for m in members(t):
                self.pending.remove(m)
            t.demand = demands[a.key]
            self._start(t, by_id[a.device_id], a.sm_percent)

    def _fused_units(self, units: dict, demands: dict, devices) -> tuple[dict, dict]:
        """Replace the pending trials of one fusion key by fused groups (:func:`hpdl.hpo.grouping.form_groups`);
        a trial held back for a fuller group is in neither result this tick."""
        fuse, kinds = self._fuse, {d.kind for d in devices}
        demands = dict(demands)
        for t in self.pending:  # the estimate budget left some out: a structure estimated once serves them all
            if t.number not in demands and self.profiles.get(t.skey, "static") is not None:
                demands[t.number] = self._demand(t, kinds)
        units = {t.number: t for t in self.pending if t.number in demands}  # asking order
        missing = any(t.number not in demands for t in self.pending)  # more may join their groups next tick
        biggest = max(d.memory_bytes for d in devices)
        ctx = CONTEXT_BYTES if self._cuda else 0
        fixed = self.spec.fixed
        keys = {n: self.workload.fusion_key({**fixed, **t.params}) for n, t in units.items()}
        groups = grouping.form_groups(
            list(units.values()), lambda t: keys[t.number], fuse.max_trials, fuse.wait_s, self._short or missing,
            time.monotonic(),
            limit=lambda t: grouping.largest_group(demands[t.number].memory_bytes, biggest, ctx)
            if self.policy.uses_profiles else fuse.max_trials)
        out_units, out_demands = {}, {}
        for chunk in groups:
            lead = chunk[0]
            if len(chunk) == 1:
                out_units[lead.number], out_demands[lead.number] = lead, demands[lead.number]
                continue
            g = _Group(lead.number, lead.trial_id, lead.lineage, lead.params,
                       grouping.group_skey(lead.skey, len(chunk)), min(m.since for m in chunk),
                       attempt=lead.attempt, members=list(chunk))
            out_units[g.number], out_demands[g.number] = g, self._demand(g, kinds)
        return out_units, out_demands

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

