"""Placement: which pending trial runs where. :class:`Placement` works out what each pending trial needs (a
measured profile or a meta-device estimate), shows the policy (:mod:`hpdl.hpo.policies`) the devices'
states, starts its assignments through the launcher, and moves trials: rebinding a queued one to a worker
that freed first, preempting for a removed device or a ``pack_hetero`` migration. It also keeps the
profiles up to date from what workers report. It reads no trial's state in the store and writes only the
Ray GPU fraction; ending trials is :class:`hpdl.hpo.faults.FaultHandler`'s job.
"""

from __future__ import annotations

import time

from hpdl.hpo import grouping, messages
from hpdl.hpo.fusion import fused_memory
from hpdl.hpo.launch import send
from hpdl.hpo.policies import SMALL_BYTES, DeviceState, SchedulingPolicy, TrialDemand
from hpdl.hpo.profiler import CONTEXT_BYTES, ProfileCache, TrialProfile, static_profile
from hpdl.hpo.runs import FusedGroup, TrialQueue, TrialRun, members

_ESTIMATE_BUDGET_S = 0.05  # static estimates per loop tick: dispatch what is known instead of waiting for all
_MIGRATE_EVERY_S = 2.0  # pack_hetero: how often running trials are ranked and migrations asked for


def group_profiles(profiles: ProfileCache, skey: str, kinds: set[str], context_bytes: int) -> list[TrialProfile]:
    """Measured profiles of a fused group of key ``skey`` (:func:`hpdl.hpo.grouping.group_skey`), per device
    kind in ``kinds``: its own size's, else scaled from the nearest measured size of its structure (a lone
    trial of it counts as size 1; :func:`hpdl.hpo.grouping.scale_profile`, ``context_bytes`` once per
    process). A kind with neither is left out."""
    k, structure = grouping.parse_group_skey(skey)
    out = []
    for kind in kinds:
        own = profiles.get(skey, kind)
        if own is not None and own.measured:
            out.append(own)
            continue
        near = []
        for key, prof in profiles.items():
            pkind, _, pkey = key.partition("|")
            kk, st = grouping.parse_group_skey(pkey)
            if pkind == kind and st == structure and prof.measured:
                near.append((abs(kk - k), kk, prof))
        if near:
            _, kk, prof = min(near, key=lambda x: (x[0], -x[1]))
            mem, st, comp = grouping.scale_profile(prof.memory_bytes, prof.step_time_s, prof.compute, kk, k,
                                                   context_bytes)
            out.append(TrialProfile(kind, mem, st, comp, prof.flops * k / kk, prof.source))
    return out


class Placement:
    """Places the queue's pending trials and moves running ones (see module docstring). Not thread-safe.

    Args:
        policy: the placement policy; ``observe`` gets every measured profile.
        profiles: the study's profile cache (``run_dir/profiles.json``), read and updated here.
        workload: the study's workload (schedules, estimates, fusion keys).
        fixed: the study's fixed parameters.
        queue: the driver's trial queue.
        launcher: starts and feeds worker processes (:mod:`hpdl.hpo.launch`).
        ledger: fails a trial larger than every device (``too_big``).
        study: the ``optuna.Study`` (``pack_hetero`` ranks running trials by their reports).
        direction: ``"minimize"`` or ``"maximize"``.
        task_info: what every task carries: ``host``, ``study_uid``, ``checkpoint_dir``.
        storage: the study's Optuna storage (running trials' reports; a Ray task's GPU fraction).
        context_bytes: a CUDA context's bytes in a static estimate (0 on a pool of CPU devices).
        fuse: the study's fusion options, or None.
        ray: trials run as Ray tasks: each records its GPU fraction in the store.
    """

    def __init__(self, policy: SchedulingPolicy, profiles: ProfileCache, workload, fixed: dict, queue: TrialQueue,
                 launcher, ledger, study, direction: str, task_info: dict, storage, context_bytes: int = 0,
                 fuse: grouping.FuseOptions | None = None, ray: bool = False):
        self.policy, self.profiles, self.workload, self.fixed = policy, profiles, workload, fixed
        self.queue, self.launcher, self.ledger, self.study = queue, launcher, ledger, study
        self.direction, self.task_info, self.context_bytes, self.fuse = direction, task_info, context_bytes, fuse
        self.storage, self.ray = storage, ray
        self.migrated = 0  # pack_hetero: trials preempted to move to a faster GPU
        self._last_migrate = 0.0

    # -- what a trial needs

    def demand(self, t: TrialRun, kinds: set[str]) -> TrialDemand:
        """``t``'s demand on devices of ``kinds``: the largest measured profile, else its static estimate;
        the baseline policies (``uses_profiles`` False) place blind, with no estimate on their critical path."""
        if isinstance(t, FusedGroup) and self.policy.uses_profiles:
            measured = group_profiles(self.profiles, t.skey, kinds, self.context_bytes)
        else:
            measured = [p for k in kinds if (p := self.profiles.get(t.skey, k)) is not None and p.measured]
        steps = self.workload.schedule(self.workload.resolve({**self.fixed, **t.params}))[0]
        if not self.policy.uses_profiles:
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

    def demands(self, devices) -> dict[int, TrialDemand]:
        """Demands of the pending trials, oldest first. A trial whose structure has neither a profile nor a
        static estimate yet needs a meta-device trace (about 0.1 s); after ``_ESTIMATE_BUDGET_S`` of those in
        one call the rest wait for the next call, so the first trials start without waiting for every
        estimate of a deep lookahead."""
        kinds = {d.kind for d in devices}
        deadline = time.monotonic() + _ESTIMATE_BUDGET_S
        out, traced = {}, 0
        for t in self.queue.pending:
            known = (not self.policy.uses_profiles or self.profiles.get(t.skey, "static") is not None
                     or any((p := self.profiles.get(t.skey, k)) is not None and p.measured for k in kinds))
            if known or not traced or time.monotonic() < deadline:  # at least one new estimate a call
                traced += not known
                out[t.number] = self.demand(t, kinds)
        return out

    def _static(self, t: TrialRun, kind: str) -> TrialProfile:
        if isinstance(t, FusedGroup):  # K times one trial's bound, with one context
            one = self._static(t.members[0], kind)
            k = len(t.members)
            return TrialProfile("static", fused_memory(one.memory_bytes, k, self.context_bytes),
                                flops=one.flops * k, source="static")
        st = self.profiles.get(t.skey, "static")
        if st is None:
            st = static_profile(self.workload, {**self.fixed, **t.params}, "static", self.context_bytes)
            self.profiles.put(t.skey, st)
        return st

    def device_states(self, devices) -> list[DeviceState]:
        """What the policy sees of ``devices``: the demands of the trials running there, and an idle worker's
        CUDA context as a small running demand."""
        states = {d.id: DeviceState(d) for d in devices}
        for t in self.queue.running.values():
            if t.device_id in states and t.demand is not None:
                states[t.device_id].running.append(t.demand)
        for w in self.launcher.workers:  # an idle worker still holds its CUDA context
            if w.trial is None and w.device_id in states and states[w.device_id].device.torch_device != "cpu":
                states[w.device_id].running.append(TrialDemand(-1 - id(w) % 10**9, CONTEXT_BYTES, 0.0,
                                                               0.0, profiled=True))
        return list(states.values())

    # -- what workers report

    def observe_profile(self, t: TrialRun, profile: dict) -> None:
        """A measured profile of ``t``'s first steps: cache it (a larger measured peak already cached stays),
        let the policy learn from it, and re-plan ``t``'s demand."""
        prof = TrialProfile(**profile)
        old = self.profiles.get(t.skey, prof.kind)
        if old is not None and old.measured and old.memory_bytes > prof.memory_bytes:
            prof.memory_bytes = old.memory_bytes  # a sibling's whole-run peak or an OOM's 1.5x stays
        self.profiles.put(t.skey, prof)
        st = self.profiles.get(t.skey, "static")
        ratio = prof.memory_bytes / st.memory_bytes if st is not None and st.memory_bytes > SMALL_BYTES else 0.0
        self.policy.observe(prof.compute, prof.flops, ratio, prof.step_time_s)
        t.demand = self.demand(t, {prof.kind})

    def observe_peak(self, t: TrialRun, kind: str, peak_bytes: int) -> None:
        """``t``'s whole-run peak (evaluations included) on a device of ``kind``: it raises a measured profile,
        never lowers it, and never turns an estimate into a measurement."""
        prof = self.profiles.get(t.skey, kind)
        if prof is not None and prof.measured and peak_bytes > prof.memory_bytes:
            prof.memory_bytes = int(peak_bytes)
            self.profiles.put(t.skey, prof)

    def grow_after_oom(self, t: TrialRun) -> None:
        """``t`` ran out of memory: its profile under-estimated, so never place this configuration (or group
        size) so tightly again (1.5x on every device kind)."""
        for k, p in self.profiles.items():
            if k.endswith("|" + t.skey):
                p.memory_bytes = int(p.memory_bytes * 1.5)
                self.profiles.put(t.skey, p)

    # -- starting

    def place(self, devices, filling: bool) -> None:
        """Ask the policy to place the pending trials on ``devices`` and start its assignments; a trial
        measured larger than every device fails for good (``too_big``). ``filling``: more trials are being
        asked for now, so a fused group that is not full may wait for them."""
        pending = self.queue.pending
        states = self.device_states(devices)
        by_id = {d.id: d for d in devices}
        demands = self.demands(devices)
        biggest = max(d.memory_bytes for d in devices)
        for t in [t for t in pending if t.number in demands and demands[t.number].profiled
                  and demands[t.number].memory_bytes > biggest]:
            pending.remove(t)  # measured, and larger than any device: it can never run
            need = demands.pop(t.number).memory_bytes
            self.ledger.fail(t.number, t.params, {"hpdl_lineage": t.lineage}, "too_big",
                             f"needs {need} B, largest device has {biggest} B", retry=False)
        units = {t.number: t for t in pending if t.number in demands}
        if self.fuse is not None:
            units, demands = self._fused_units(demands, devices, filling)
        for a in self.policy.place(list(demands.values()), states):
            t = units[a.key]
            for m in members(t):
                pending.remove(m)
            t.demand = demands[a.key]
            self._start(t, by_id[a.device_id], a.sm_percent)

    def _fused_units(self, demands: dict, devices, filling: bool) -> tuple[dict, dict]:
        """Replace the pending trials of one fusion key by fused groups (:func:`hpdl.hpo.grouping.form_groups`);
        a trial held back for a fuller group is in neither result this call."""
        pending, kinds = self.queue.pending, {d.kind for d in devices}
        demands = dict(demands)
        for t in pending:  # the estimate budget left some out: a structure estimated once serves them all
            if t.number not in demands and self.profiles.get(t.skey, "static") is not None:
                demands[t.number] = self.demand(t, kinds)
        units = {t.number: t for t in pending if t.number in demands}  # asking order
        missing = any(t.number not in demands for t in pending)  # more may join their groups next call
        biggest = max(d.memory_bytes for d in devices)
        keys = {n: self.workload.fusion_key({**self.fixed, **t.params}) for n, t in units.items()}
        groups = grouping.form_groups(
            list(units.values()), lambda t: keys[t.number], self.fuse.max_trials, self.fuse.wait_s,
            filling or missing, time.monotonic(),
            limit=lambda t: grouping.largest_group(demands[t.number].memory_bytes, biggest, self.context_bytes)
            if self.policy.uses_profiles else self.fuse.max_trials)
        out_units, out_demands = {}, {}
        for chunk in groups:
            lead = chunk[0]
            if len(chunk) == 1:
                out_units[lead.number], out_demands[lead.number] = lead, demands[lead.number]
                continue
            g = FusedGroup(lead.number, lead.trial_id, lead.lineage, lead.params,
                           grouping.group_skey(lead.skey, len(chunk)), min(m.since for m in chunk),
                           attempt=lead.attempt, members=list(chunk))
            out_units[g.number], out_demands[g.number] = g, self.demand(g, kinds)
        return out_units, out_demands

    def task(self, t: TrialRun, device) -> messages.Task:
        """The task message that runs ``t`` on ``device`` (with a profile request while its structure has no
        measured profile on that kind, and the policy's memory cap)."""
        need_profile = self.policy.uses_profiles and (not (p := self.profiles.get(t.skey, device.kind))
                                                      or not p.measured)
        info = self.task_info
        return messages.Task(
            t.trial_id, t.number, t.lineage, t.params, device_id=device.id, **info,
            profile=need_profile, static=self._static(t, device.kind).__dict__ if need_profile else None,
            context_bytes=CONTEXT_BYTES if device.torch_device.startswith("cuda") else 0,
            memory_cap=self.policy.memory_cap(t.demand, device) if t.demand is not None else None,
            fused=tuple(messages.Task(m.trial_id, m.number, m.lineage, m.params, device_id=device.id, **info)
                        for m in members(t)) if isinstance(t, FusedGroup) else ())

    def _start(self, t: TrialRun, device, sm_percent: int) -> None:
        """Start ``t`` on ``device``: a warm local worker, or a Ray task with ``num_gpus`` from the policy."""
        frac = self.policy.gpu_fraction(t.demand, device)
        w = self.launcher.start(device, self.task(t, device), sm_percent, frac)
        w.trial, t.worker, t.device_id = t, w, device.id  # the worker records host, pid and start time
        self.queue.running[t.number] = t
        if self.ray:
            self.storage.set_trial_user_attr(t.trial_id, "hpdl_gpu_fraction", frac)

    # -- moving

    def rebind(self) -> None:
        """Move each trial still queued on a starting worker to an idle ready worker of the same device (a
        warm worker that finished a trial while the new one starts): it starts now instead of after the
        cold start. The starting worker stays, idle, for later trials."""
        for w in [w for w in self.launcher.workers if w.queued is not None and w.trial is not None]:
            spare = self.launcher.idle_ready(w)
            if spare is None:
                continue
            if not send(spare, messages.RunTask(task=w.queued)):
                continue  # the spare just died (reaping removes it): the trial stays queued where it was
            t = w.trial
            w.trial, w.queued, w.idle_since = None, None, time.monotonic()
            spare.trial, t.worker = t, spare

    def preempt(self, t: TrialRun) -> None:
        """Stop ``t`` with a checkpoint so it continues elsewhere; a trial still queued on a starting worker
        goes straight back to the pending queue."""
        w = t.worker
        if w is not None and w.queued is not None:
            w.trial, w.queued, w.idle_since = None, None, time.monotonic()
            self.queue.requeue(t)
            return
        t.preempt_at = time.monotonic()
        send(w, messages.Preempt(trial_id=t.trial_id))

    def elastic(self, devices) -> None:
        """The pool lost devices: idle workers on them stop, their trials are preempted (to run elsewhere)."""
        ids = {d.id for d in devices}
        for w in self.launcher.workers:
            if w.device_id in ids:
                continue
            t = w.trial
            if t is None:
                if not w.stopping:
                    w.stopping = True
                    send(w, messages.Stop())
            elif not t.preempt_at:
                self.preempt(t)

    def migrate(self, devices) -> None:
        """pack_hetero: mark running trials better than the median at their last report as promising and
        move those the policy picks to faster GPUs (preempt with a checkpoint; they are re-placed first)."""
        if not self.policy.migrates or time.monotonic() - self._last_migrate < _MIGRATE_EVERY_S:
            return
        self._last_migrate = time.monotonic()
        by_step: dict[int, list[float]] = {}
        for fz in self.study.get_trials(deepcopy=False):
            for step, v in fz.intermediate_values.items():
                by_step.setdefault(step, []).append(v)
        sign = 1.0 if self.direction == "maximize" else -1.0
        for t in self.queue.running.values():
            iv = self.storage.get_trial(t.trial_id).intermediate_values
            if iv and t.demand is not None:
                step = max(iv)
                peers = sorted(by_step.get(step, []))
                t.priority = float(len(peers) >= 3 and sign * (iv[step] - peers[len(peers) // 2]) > 0)
                t.demand.priority = t.priority
        for key in self.policy.migrations(self.device_states(devices)):
            t = self.queue.running[key]
            if not t.preempt_at:
                self.migrated += 1
                self.preempt(t)
