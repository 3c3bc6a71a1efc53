"""Placement policies: which queued trial starts on which GPU (pure CPU bookkeeping, no processes).

The packing problem (HyperSack, seed abstract 4; design reading in docs/hpo.md): items are trials with a
peak memory ``m_i`` (bytes) and a compute share ``b_i`` (the fraction of time the GPU is busy when the trial
runs alone, measured by :mod:`hpdl.hpo.profiler`); bins are GPUs with memory ``M_g`` and a speed factor
``s_g``. Without MPS, processes on one GPU time-slice, so co-located trials progress at full speed while
``sum(b_i) <= 1`` and slow down by ``sum(b_i)`` beyond it; memory is a hard limit (an overflow is an
out-of-memory failure). Each policy answers one question, ``place(pending, devices)``, and the driver and
the simulator both call the same objects.

Policies: ``one_per_gpu`` (standard HPO parallelisation, the baseline), ``fixed_fraction`` (Ray Tune style
``{"gpu": f}``: ``floor(1/f)`` trials per GPU, memory ignored), ``pack`` (two-dimensional fit, memory hard,
compute soft), ``pack_hetero`` (``pack`` plus speed-aware choice: long or promising trials to fast GPUs).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

from hpdl.hpo.errors import HpoConfigError

GIB = 1 << 30
# Static memory bounds at most this size: activations do not dominate them, so they held in every profile
# (the measured/static ratio is learned only from larger ones) and a wrong guess cannot exhaust a GPU.
SMALL_BYTES = 2 * GIB


@dataclass(frozen=True)
class Device:
    """One GPU (or fake CPU device) of the pool.

    Attributes:
        id: stable name, e.g. ``"cuda:0"``, ``"node3/cuda:1"`` or ``"fake:0"``.
        kind: device type, e.g. ``"H200"``, ``"A100-40GB"``; profiles are cached per kind.
        memory_bytes: memory trials may use (bytes), after the driver's headroom.
        speed: relative throughput of this kind for compute-bound work (reference kind = 1.0).
        compute: compute capacity in busy-fraction units (1.0 = one fully busy GPU).
        torch_device: where a trial process trains, e.g. ``"cuda:0"`` or ``"cpu"`` for a fake device.
        peak_flops: declared peak (FLOP/s) of a fake CPU device, for its compute shares; 0 for GPUs.
    """

    id: str
    kind: str
    memory_bytes: int
    speed: float = 1.0
    compute: float = 1.0
    torch_device: str = "cpu"
    peak_flops: float = 0.0

    def __post_init__(self):
        if self.memory_bytes <= 0:
            raise HpoConfigError(f"Device {self.id}: memory_bytes={self.memory_bytes}, expected > 0")
        if self.speed <= 0 or self.compute <= 0:
            raise HpoConfigError(f"Device {self.id}: speed={self.speed}, compute={self.compute}, expected > 0")


@dataclass
class TrialDemand:
    """What a trial needs, as the scheduler sees it.

    Attributes:
        key: trial number (unique within the study); negative keys are idle worker processes that hold
            memory (their CUDA context) but run nothing.
        memory_bytes: peak device memory of the trial's process (bytes), measured or estimated.
        compute: busy fraction in (0, 1] when alone on a speed-1 device; 1.0 when unknown.
        work_s: remaining solo run time on a speed-1 device (seconds); a rough estimate is fine.
        priority: larger is more promising (e.g. best intermediate rank); used by ``pack_hetero``.
        waited_s: seconds since the trial became ready to run (for starvation control).
        profiled: ``True`` once ``memory_bytes`` and ``compute`` come from a measurement.
        flops: FLOPs of one training step (static estimate; 0 = unknown), used to guess the compute share
            and step time of a trial not yet profiled from the profiled trial nearest in FLOPs.
        steps: training steps the trial runs (0 = unknown); with a guessed step time it estimates the
            solo run time of a trial not yet profiled (``Pack(order="longest")``).
    """

    key: int
    memory_bytes: int
    compute: float = 1.0
    work_s: float = 1.0
    priority: float = 0.0
    waited_s: float = 0.0
    profiled: bool = False
    flops: float = 0.0
    steps: int = 0


@dataclass
class DeviceState:
    """A device and the demands of the trials now placed on it."""

    device: Device
    running: list[TrialDemand] = field(default_factory=list)

    @property
    def memory_used(self) -> int:
        return sum(t.memory_bytes for t in self.running)

    @property
    def compute_used(self) -> float:
        return sum(t.compute for t in self.running)


@dataclass(frozen=True)
class Assignment:
    """Start trial ``key`` on device ``device_id``; ``sm_percent`` is the MPS SM cap (100 = none)."""

    key: int
    device_id: str
    sm_percent: int = 100


class SchedulingPolicy(ABC):
    """Decides placements. Contract: ``place`` is pure (it does not mutate its arguments), returns each
    pending key at most once, and names only devices it was given. It is called from one thread only."""

    name = "base"
    uses_profiles = True  # False: the driver skips in-place profiling (the policy would ignore it)

    @abstractmethod
    def place(self, pending: Sequence[TrialDemand], devices: Sequence[DeviceState]) -> list[Assignment]:
        """Return the trials to start now, chosen from ``pending`` (oldest first), onto ``devices``."""

    def max_concurrency(self) -> int:
        """The most trials this policy ever runs at once on one device (sizes the warm worker pool)."""
        return 1

    def gpu_fraction(self, demand: TrialDemand, device: Device) -> float:
        """The share of ``device`` this policy gives ``demand``, for resource managers that account GPUs in
        fractions (Ray's ``num_gpus``): 1.0 here (a whole GPU per trial)."""
        return 1.0

    def memory_cap(self, demand: TrialDemand, device: Device) -> int | None:
        """Bytes the trial's process may hold on ``device`` (CUDA context included), enforced by the worker
        through the caching allocator; ``None``: no cap (here: the baselines place blind)."""
        return None

    # Optional features: the driver calls these hooks on every policy; the defaults do nothing.
    migrates = False  # True: the driver ranks running trials (priority) and asks :meth:`migrations`

    def observe(self, compute: float, flops: float = 0.0, memory_ratio: float = 0.0,
                step_time_s: float = 0.0) -> None:
        """A configuration's profile arrived: its compute share, FLOPs per step, measured/static memory ratio
        and solo step time (s). Default: ignored."""

    def migrations(self, devices: Sequence[DeviceState]) -> list[int]:
        """Keys of running trials to move (checkpoint, stop, place again). Default: none."""
        return []

    def set_mps(self, active: bool) -> None:
        """Whether co-located trials' kernels run side by side (an MPS daemon serves the workers). Default:
        ignored (the policy's placement does not depend on it)."""

    def limit_trials_per_device(self, cpu_bound: int) -> None:
        """The most trials per device the host's cores can drive (one core each, one for the driver), for a
        policy whose own limit was left unset. Default: ignored."""


class OnePerGpu(SchedulingPolicy):
    """Standard HPO parallelisation: one trial per GPU, FIFO (Optuna/Ray Tune default with 1 GPU a trial)."""

    name = "one_per_gpu"
    uses_profiles = False

    def place(self, pending, devices):
        free = [d.device.id for d in devices if not any(t.key >= 0 for t in d.running)]
        return [Assignment(t.key, dev) for t, dev in zip(pending, free)]


class FixedFraction(SchedulingPolicy):
    """Naive sharing, as Ray Tune's ``tune.with_resources(fn, {"gpu": fraction})``: at most
    ``floor(1/fraction)`` trials per GPU, FIFO, blind to memory and compute (it can run out of memory)."""

    name = "fixed_fraction"
    uses_profiles = False

    def __init__(self, fraction: float = 0.125):
        if not 0 < fraction <= 1:
            raise HpoConfigError(f"fraction={fraction}, expected 0 < fraction <= 1")
        self.fraction = fraction
        self.slots = int(math.floor(1.0 / fraction + 1e-9))

    def max_concurrency(self) -> int:
        return self.slots

    def gpu_fraction(self, demand, device):
        return self.fraction

    def place(self, pending, devices):
        out, queue = [], list(pending)
        # Ray fills the least-loaded node/GPU first; mirror that with round-robin over free slots.
        load = {d.device.id: sum(t.key >= 0 for t in d.running) for d in devices}
        while queue:
            dev = min(load, key=lambda k: load[k], default=None)
            if dev is None or load[dev] >= self.slots:
                break
            out.append(Assignment(queue.pop(0).key, dev))
            load[dev] += 1
        return out


class Pack(SchedulingPolicy):
    """Resource-aware packing: place a trial where its memory fits under the device limit (hard) and the
    device's summed compute share is still under ``max_compute`` (soft: co-locate only where idle GPU time
    is left to gain; the last trial may push the sum past the cap, which only time-slices).

    Pending trials are tried in ``order``; each goes to the fitting device with the lowest resulting
    speed-weighted load, which spreads work over idle GPUs before stacking.
    A trial that waited longer than ``starve_after_s`` is tried first and reserves the device where it would
    fit soonest: nothing else is started there until it fits.

    Args:
        max_compute: a device whose summed busy fraction reached this takes no more light trials. Default
            (``None``): 2.0, or 8.0 under MPS, calibrated on an H200 (docs/benchmarks/hpo.md): the busy
            fraction covers training steps only (start-up and evaluations leave the GPU idle); time-sliced,
            7 light trials (busy fraction <= 0.2) ran 1.49x slower each, trials of >= 0.5 next to 7 others
            10-12x slower. Under MPS a busy fraction is a share of time, not of SMs (small kernels leave
            most SMs idle while "busy"), and 8.0 beat 4.0 in each of four runs (64 trials, 1 and 2 x H200,
            both benchmark spaces: 5.8-13.7 % less wall time), single runs each.
        light_below: trials with a measured (or measured-neighbour) busy fraction under this are light;
            time-sliced, a heavier trial joins a device only if the sum after it stays within
            ``min(1, max_compute)``, and a device running one takes more trials only on the same terms (under
            MPS: within ``max_compute``, see ``mps``).
        max_trials_per_device: cap on co-located processes (each needs a CPU core to launch its kernels and
            a CUDA context); ``None``: the driver sets it from the host's cores per GPU
            (``(cores - 1) // gpus``), 16 elsewhere (simulator).
        unprofiled_compute: share assumed for a trial not yet profiled, until profiles arrive; after that
            the share measured in this study (``observe``) for the configuration nearest in FLOPs per step
            (log scale) is assumed, or the median share when FLOPs are unknown.
        starve_after_s: waiting time after which a trial reserves a device.
        mps: the GPUs run an MPS server for the trial processes (``True``; ``"auto"``: detect a daemon;
            the study file's ``mps`` key sets it, see :mod:`hpdl.hpo.mps`). Co-located kernels then run
            concurrently instead of time-slicing, so a heavy trial (busy fraction >= ``light_below``) may
            share a GPU with light ones up to ``max_compute`` too, not only up to one GPU, and before the
            first profile small trials (static bound at most ``SMALL_BYTES``) may fill a GPU. Measured on an
            H200 (benchmarks/mps_colocation.py): under MPS four GPU-bound trials together ran 2.05x slower
            each (4.36x time-sliced), fourteen light ones 1.36x (3.54x); one GPU-bound trial next to
            fourteen light ones 1.17x, while those light ones ran 1.63x slower.
        sm_caps: under MPS, give each trial ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = ceil(100 * compute /
            max_compute)``. Off by default: the busy fraction is a share of time, not of SMs (a trial busy 15 %
            of the time may still need every SM while it is busy), and a capped trial needs a worker started
            with that cap, so it cannot use the warm pool.
        order: which pending trials are tried first. ``"longest"`` (default): longest estimated solo run
            time first (LPT, the classic makespan order; ties by memory), so that long launch-bound trials,
            small in memory, do not trail at the end of a study; a trial not yet profiled is estimated from
            its steps and the step time of the profiled configuration nearest in FLOPs per step
            (:meth:`_work`). ``"memory"``: largest planned memory first (first-fit decreasing, the classic
            bin-packing order; the default before 2026-11-30, slower than ``"longest"`` in six of six paired
            runs on 1 and 2 x H200 by 0-20 %, docs/benchmarks/hpo.md).
        memory_caps: cap each trial whose planned memory exceeds ``SMALL_BYTES`` at that plan
            (:meth:`memory_cap`), so it can never take memory the packing gave a neighbour. Measured on an
            H200: an unprofiled batch-16384 CNN placed on its 15.6 GiB static bound grew to 26.8 GiB (cuDNN
            picks workspace-hungry algorithms when memory is free) and a neighbour ran out of memory.
    """

    name = "pack"

    def __init__(self, max_compute: float | None = None, max_trials_per_device: int | None = None,
                 unprofiled_compute: float = 0.25, starve_after_s: float = 30.0, mps: bool | str = False,
                 light_below: float = 0.5, sm_caps: bool = False, memory_caps: bool = True,
                 order: str = "longest"):
        if order not in ("memory", "longest"):
            raise HpoConfigError(f"order={order!r}, expected 'memory' or 'longest'")
        self.order = order
        if max_compute is not None and not 0 < max_compute < math.inf:  # nan and inf too
            raise HpoConfigError(f"max_compute={max_compute}, expected a finite number > 0")
        if not 0 < light_below <= 1:
            raise HpoConfigError(f"light_below={light_below}, expected in (0, 1]")
        self.light_below = light_below
        if max_trials_per_device is not None and max_trials_per_device < 1:
            raise HpoConfigError(f"max_trials_per_device={max_trials_per_device}, expected >= 1")
        if isinstance(unprofiled_compute, bool) or not 0 < unprofiled_compute < math.inf:  # nan too
            raise HpoConfigError(f"unprofiled_compute={unprofiled_compute}, expected a finite share > 0 "
                                 "(0 packs unprofiled trials up to the memory limit: 32 on 2 GPUs instead of 8)")
        if isinstance(starve_after_s, bool) or not starve_after_s >= 0:  # nan too; inf: never reserve
            raise HpoConfigError(f"starve_after_s={starve_after_s}, expected seconds >= 0")
        self._max_compute = max_compute
        self.max_trials_per_device = max_trials_per_device
        self.unprofiled_compute = unprofiled_compute
        self._observed: list[tuple[float, float]] = []      # (compute share, FLOPs per step)
        self._step_times: list[tuple[float, float]] = []    # (solo step time s, FLOPs per step)
        self._mem_ratio = 1.0  # largest measured/static peak-memory ratio seen (scales unprofiled bounds)
        self.starve_after_s = starve_after_s
        if mps not in (True, False, "auto"):
            raise HpoConfigError(f"mps={mps!r}, expected true, false or 'auto'")
        self.mps = mps_active() if mps == "auto" else bool(mps)
        self.sm_caps = bool(sm_caps)
        self.memory_caps = bool(memory_caps)

    @property
    def max_compute(self) -> float:
        """The summed busy fraction a device may reach: as given, else 2.0 (time-slicing) or 8.0 (MPS)."""
        if self._max_compute is not None:
            return float(self._max_compute)
        return 8.0 if self.mps else 2.0

    @property
    def cap(self) -> int:
        """Effective ``max_trials_per_device`` (16 when unset and no driver set it)."""
        return self.max_trials_per_device or 16

    def set_mps(self, active: bool) -> None:
        self.mps = bool(active)

    def limit_trials_per_device(self, cpu_bound: int) -> None:
        if self.max_trials_per_device is None:
            self.max_trials_per_device = max(1, int(cpu_bound))

    def max_concurrency(self) -> int:
        return self.cap

    def gpu_fraction(self, demand, device):
        """The trial's share of the device's memory, rounded down to Ray's 1e-4 granularity (at least
        1e-4): memory is the hard limit the packing keeps, so the shares on one GPU sum to at most 1."""
        return min(1.0, max(1e-4, math.floor(demand.memory_bytes / device.memory_bytes * 1e4) / 1e4))

    def memory_cap(self, demand, device):
        """The memory the packing counts for ``demand`` on ``device`` (bytes, context included), for trials
        planned above ``SMALL_BYTES``; ``None`` for smaller ones, for an unprofiled trial whose plan exceeds
        the device (it runs alone to be profiled) and with ``memory_caps=False``.

        A capped trial cannot hold more than the packing counted for it: cuDNN then picks algorithms whose
        workspace fits (PyTorch tries the next one when a workspace allocation fails), and a trial that
        cannot run within its plan fails alone, is retried and planned 1.5x larger. The cap is lowered to
        the measured peak when the profile arrives (the plan from then on). Small trials stay uncapped, so
        the bound does not cover them: a plan from a few training steps misses an evaluation on a larger
        batch (measured: up to about 2 GiB more in a configuration's first run; its whole-run peak then
        replaces the profile's)."""
        mem = self._mem(demand)
        if not self.memory_caps or mem <= SMALL_BYTES or mem > device.memory_bytes:
            return None
        return mem

    def observe(self, compute: float, flops: float = 0.0, memory_ratio: float = 0.0,
                step_time_s: float = 0.0) -> None:
        """Record a measured compute share, the FLOPs per step and the solo step time (seconds; 0: not
        given) of its configuration. A trial not yet profiled is then assumed to need the share and step
        time of the profiled configuration nearest in FLOPs (GPU time grows with FLOPs; host time much
        less), or the median share when FLOPs are unknown.

        ``memory_ratio`` is the measured peak over the static bound of that configuration (0: not given; the
        driver gives it for bounds over 2 GiB, where activations dominate). Static bounds of unprofiled
        trials are scaled by the largest ratio seen (at least 1): measured on an H200, batch-16384 CNNs peaked
        at up to 1.7x their static bound (cuDNN workspaces, gradient buffers), which on an 80 GB GPU
        would be an out-of-memory failure."""
        self._observed.append((float(compute), float(flops)))
        if step_time_s > 0 and flops > 0:
            self._step_times.append((float(step_time_s), float(flops)))
        if memory_ratio > self._mem_ratio:
            self._mem_ratio = float(memory_ratio)

    def _mem(self, t: TrialDemand) -> int:
        """Memory placement counts for ``t``: measured, or the static bound scaled by the ratio learned."""
        return t.memory_bytes if t.profiled or t.key < 0 else int(t.memory_bytes * self._mem_ratio)

    def _prior(self, flops: float = 0.0) -> float:
        if not self._observed:
            return self.unprofiled_compute
        near = [(abs(math.log(f / flops)), c) for c, f in self._observed if f > 0] if flops > 0 else []
        if near:
            return min(near)[1]
        xs = sorted(c for c, _ in self._observed)
        return xs[len(xs) // 2]

    def _compute(self, t: TrialDemand) -> float:
        return t.compute if t.profiled else max(t.compute if t.compute < 1.0 else 0.0, self._prior(t.flops))

    def _work(self, t: TrialDemand) -> float:
        """Estimated solo run time (s): measured for a profiled trial, else its steps times a step time
        guessed from the profiled configuration nearest in FLOPs per step, scaled up by the FLOPs ratio when
        ``t`` has more (a step never takes less than the launch-bound floor measured there), else
        ``t.work_s``. Profiles are measured in place, beside other trials, so "solo" is approximate (a
        batch-16384 configuration's profiled steps summed to 1.7x its measured solo run); a retried trial
        is estimated at its full steps, not what is left after its checkpoint."""
        if t.profiled or t.steps <= 0 or not 0 < t.flops < math.inf or not self._step_times:
            return t.work_s
        _, st, f = min((abs(math.log(f / t.flops)), st, f) for st, f in self._step_times)
        return t.steps * st * max(1.0, t.flops / f)

    def _order(self, pending: Sequence[TrialDemand]) -> list[TrialDemand]:
        if self.order == "longest":
            return sorted(pending, key=lambda t: (-self._work(t), -t.memory_bytes, t.key))
        return sorted(pending, key=lambda t: (-t.memory_bytes, t.key))

    def _score(self, t: TrialDemand, dev: Device, comp: float, work: float) -> float:
        """Lower is better: resulting compute load relative to the device's speed."""
        return (comp + self._compute(t)) / (dev.compute * dev.speed)

    def place(self, pending, devices):
        mem = {d.device.id: sum(self._mem(t) for t in d.running) for d in devices}
        comp = {d.device.id: sum(self._compute(t) for t in d.running) for d in devices}
        # entries with a negative key are idle worker processes (memory only): not trials
        count = {d.device.id: sum(t.key >= 0 for t in d.running) for d in devices}
        work = {d.device.id: sum(self._work(t) for t in d.running if t.key >= 0) for d in devices}
        heavy = {d.device.id: any(t.key >= 0 and not self._light(t) for t in d.running) for d in devices}
        by_id = {d.device.id: d.device for d in devices}
        biggest = max((d.memory_bytes for d in by_id.values()), default=0)
        reserved: set[str] = set()
        order = self._order(pending)
        # Starvation control: the longest-waiting starving trial is tried first and, while it does not fit,
        # reserves the device where it would fit soonest (tried first: once that device has drained, trials
        # earlier in the order would otherwise take it again).
        starving = [t for t in pending if t.waited_s >= self.starve_after_s]
        if starving:
            t = max(starving, key=lambda x: x.waited_s)
            order = [t] + [x for x in order if x is not t]
            cands = [d for d in by_id.values() if d.memory_bytes >= self._mem(t)]
            if cands:
                dev = min(cands, key=lambda d: (mem[d.id] - (d.memory_bytes - self._mem(t)), d.id))
                if not self._fits(t, dev, mem, comp, count, biggest, heavy):
                    reserved.add(dev.id)
        out = []
        for t in order:
            fits = [d for d in by_id.values()
                    if d.id not in reserved and self._fits(t, d, mem, comp, count, biggest, heavy)]
            if not fits:
                continue
            dev = min(fits, key=lambda d: (self._score(t, d, comp[d.id], work[d.id]), d.id))
            c = self._compute(t)
            work[dev.id] += self._work(t)
            mem[dev.id] += self._mem(t)
            comp[dev.id] += c
            count[dev.id] += 1
            heavy[dev.id] = heavy[dev.id] or not self._light(t)
            sm = min(100, int(math.ceil(100 * c / self.max_compute))) if self.mps and self.sm_caps else 100
            out.append(Assignment(t.key, dev.id, sm))
        return out

    def _known(self, t) -> bool:
        """Its share was measured, or can be guessed from measured ones."""
        return t.profiled or bool(self._observed)

    def _light(self, t) -> bool:
        """Light: a busy fraction under ``light_below`` that was measured, or guessed from measured ones; a trial
        guessed before any profile exists is not (it may be a heavy one)."""
        return self._compute(t) < self.light_below and (t.profiled or bool(self._observed))

    def _small(self, t) -> bool:
        """Nothing is measured yet and the static bound is at most ``SMALL_BYTES``: a wrong guess cannot run
        a GPU out of memory, and under MPS even GPU-bound trials stacked four deep still gained throughput
        (measured: benchmarks/mps_colocation.py), so under MPS such a trial need not wait for the first
        profile (on 2 x H200 the wait left 22 of 30 warm workers idle for 5 s)."""
        return not self._known(t) and self._mem(t) <= SMALL_BYTES

    def _limit(self, t, heavy_here: bool) -> float:
        """Summed busy fraction under which ``t`` may join a device (see ``light_below``; under MPS every
        trial with a measured or guessed share, or a small one, may go up to ``max_compute``: kernels of
        co-located processes run side by side; before any profile exists a large trial gets one GPU's
        worth)."""
        if (self.mps and (self._known(t) or self._small(t))) or (not heavy_here and self._light(t)):
            return self.max_compute
        return min(1.0, self.max_compute)

    def _joins(self, t, load: float, count: int, capacity: float, heavy_here: bool) -> bool:
        """Gain test. An empty device takes any trial; a light trial joins while the load is under the cap
        (the last one may push the sum past it, which only time-slices); a heavy one only if the sum after it
        stays within the one-GPU cap (time-sliced, stacked heavy trials thrash: four ran 4.4x slower each;
        under MPS, within ``max_compute``). Under MPS a small trial not yet profiled joins as a light one.

        Letting heavy trials join under MPS while the load is under the cap, as light ones do, was measured
        on 2 x H200 and not kept: 15.9 s against 14.5 s (launch-bound) and 16.0 s against 14.9 s (mixed),
        light trials slowed more (median 3.4x against 2.1x their solo time), docs/benchmarks/hpo.md."""
        if count == 0:
            return True
        limit = self._limit(t, heavy_here) * capacity
        if (self._light(t) and ((self.mps and self._known(t)) or not heavy_here)) or (self.mps and self._small(t)):
            return load < limit - 1e-9
        return load + self._compute(t) <= limit + 1e-9

    def _fits(self, t, dev: Device, mem, comp, count, biggest: int = 0, heavy=None) -> bool:
        if mem[dev.id] + self._mem(t) > dev.memory_bytes:
            # The static bound of an unprofiled trial is generous: if it exceeds every device, try it alone
            # on the largest one (its profile will tell); a profiled trial that fits nowhere never runs.
            return (not t.profiled and count[dev.id] == 0 and self._mem(t) > biggest
                    and dev.memory_bytes == biggest)
        if count[dev.id] >= self.cap:
            return False
        # Gain test: co-locate only while the device still has idle compute (its load is under the cap);
        # an empty device always takes a trial that fits in memory.
        return self._joins(t, comp[dev.id], count[dev.id], dev.compute, bool(heavy and heavy.get(dev.id)))


class PackHetero(Pack):
    """``pack`` for pools with GPUs of different speeds: trials are taken most promising first, then
    longest first, and each goes where its estimated finish time is earliest, so long and promising trials
    land on fast GPUs and short ones fill slow GPUs.

    Its own order (``order`` is ignored); run times are :meth:`Pack._work` estimates. Cost on device ``g``
    (seconds, time-slicing model of the module docstring): the trial's own estimated
    run time ``work_s / speed_g * max(1, load_g + b)`` plus the delay it adds to the trials already there,
    ``W_g / speed_g * (max(1, load_g + b) - max(1, load_g))`` with ``W_g`` their summed remaining work.
    """

    name = "pack_hetero"

    def __init__(self, *args, migrate_min_s: float = 10.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.migrate_min_s = migrate_min_s

    def _order(self, pending):
        return sorted(pending, key=lambda t: (-t.priority, -self._work(t), -t.memory_bytes, t.key))

    migrates = True

    def migrations(self, devices: Sequence[DeviceState]) -> list[int]:
        """Running trials to move (checkpoint, stop, start again) to a faster GPU: those with
        ``priority > 0`` (promising, e.g. better than the median at their last report) whose remaining work
        on their GPU exceeds ``migrate_min_s`` and which would fit now, memory and compute, on a GPU at least
        1.5 times faster. At most one trial per target GPU per call, most promising first."""
        out, taken = [], set()
        cands = [(t, d) for d in devices for t in d.running if t.key >= 0 and t.priority > 0]
        for t, src in sorted(cands, key=lambda x: (-x[0].priority, -x[0].work_s, x[0].key)):
            if t.work_s / src.device.speed < self.migrate_min_s:
                continue
            for dst in sorted(devices, key=lambda d: -d.device.speed):
                dv = dst.device
                if dv.id in taken or dv.speed < 1.5 * src.device.speed:
                    continue
                load = sum(self._compute(x) for x in dst.running)
                heavy_there = any(x.key >= 0 and not self._light(x) for x in dst.running)
                n_there = sum(x.key >= 0 for x in dst.running)
                mem_there = sum(self._mem(x) for x in dst.running)  # as place() counts it (scaled bounds)
                if mem_there + self._mem(t) <= dv.memory_bytes and n_there < self.cap and \
                        self._joins(t, load, n_there, dv.compute, heavy_there):
                    out.append(t.key)
                    taken.add(dv.id)
                    break
        return out

    def _score(self, t, dev, comp, work):
        old = max(1.0, comp / dev.compute)
        new = max(1.0, (comp + self._compute(t)) / dev.compute)
        return self._work(t) / dev.speed * new + work / dev.speed * (new - old)


def mps_active(pipe_dir: str | None = None) -> bool:
    """True when an NVIDIA MPS control daemon is running: its pipe directory (``CUDA_MPS_PIPE_DIRECTORY``,
    default ``/tmp/nvidia-mps``) holds a ``control`` pipe and a pid file naming a live process (a pipe left
    by a killed daemon does not count). Detection only (the study file's ``mps: start`` runs a
    private daemon, :mod:`hpdl.hpo.mps`)."""
    import os

    from hpdl.hpo.mps import daemon_pid

    return daemon_pid(pipe_dir or os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")) is not None


POLICIES = {cls.name: cls for cls in (OnePerGpu, FixedFraction, Pack, PackHetero)}


def get_policy(name: str | SchedulingPolicy, **kwargs) -> SchedulingPolicy:
    """Build a policy from its name (``one_per_gpu``, ``fixed_fraction``, ``pack``, ``pack_hetero``)
    and keyword options, or pass an instance through.

    Raises:
        HpoConfigError: unknown name (the message lists the valid ones) or a bad option.
    """
    if isinstance(name, SchedulingPolicy):
        return name
    if name not in POLICIES:
        raise HpoConfigError(f"policy={name!r}, expected one of {sorted(POLICIES)}")
    try:
        return POLICIES[name](**kwargs)
    except TypeError as exc:
        raise HpoConfigError(f"policy {name!r}: bad options {kwargs}: {exc}") from None


def check_placement(devices: Sequence[DeviceState], respect_memory: bool = True) -> None:
    """Assert the invariants every placement must keep; used by tests and the simulator.

    A device running a single unprofiled trial is exempt from the memory check (that trial's static bound
    exceeded every device, so it was tried alone on the largest).

    Raises:
        AssertionError: a trial is placed twice, or (with ``respect_memory``) a device's memory is exceeded.
    """
    seen: set[int] = set()
    for d in devices:
        for t in d.running:
            assert t.key not in seen, f"trial {t.key} placed twice"
            seen.add(t.key)
        alone_unprofiled = len(d.running) == 1 and not d.running[0].profiled
        if respect_memory and not alone_unprofiled:
            assert d.memory_used <= d.device.memory_bytes, (
                f"device {d.device.id}: {d.memory_used} B placed > {d.device.memory_bytes} B capacity")
