"""Trial profiles: peak device memory, step time and compute share of a configuration on a GPU type.

Two sources, both real measurements:

- ``static_profile``: before a configuration has run, its step is traced on the meta device
  (:meth:`Workload.estimate`: parameter bytes, module-output bytes, FLOPs). Memory is bounded as
  ``1.25 * (4 * params + 2 * activations) + context`` bytes: weights, gradients and two optimizer/
  allocator copies, the module outputs autograd keeps plus as much again for gradients, cuDNN workspace and
  fragmentation. Deliberately generous so that placement before profiling does not run out of memory.
  Compute share is unknown (the policy assumes a default).
- ``StepProfiler``: the first steps of every new configuration (in the trial's own process, on the GPU it
  was placed on) are measured. After ``warmup`` steps, ``window`` steps are timed one by one: the host time
  of each step (from its start to the return of its last launch) and, on a GPU, a CUDA event after each
  step. The window's steps are enqueued behind a ``torch.cuda._sleep`` kernel long enough to cover their
  launch (1.5 x the warm-up host time, 2 to 100 ms), so an interval between two events is the GPU time of
  one step with no launch gap. An evaluation between two steps (``interrupt``) drains the queue: the
  interval across it is dropped and the sleep is issued again before the next step, so short trials that
  evaluate often still get a profile. Then:

  * ``cpu`` = the median host time of a step; ``gpu`` = the shortest event interval. Without MPS,
    co-located processes time-slice the GPU, so an interval that another process's time slice fell into is
    longer than the trial's own GPU work; the shortest interval is the one least disturbed (all steps of a
    configuration do the same work),
  * ``step_time_s = max(cpu, gpu)`` per step (the solo step time; launch-bound trials have cpu > gpu),
  * ``compute = gpu / step_time_s``, the fraction of time the GPU is busy when the trial runs alone
    (what SM-use sampling with NVML approximates); co-located processes time-slice, so trials whose
    shares sum to <= 1 can share a GPU with little slowdown,
  * ``memory_bytes = torch.cuda.max_memory_reserved() + context_bytes`` (the CUDA context of a process,
    about 0.5 GiB with cuBLAS/cuDNN, is not seen by the caching allocator).

  The measurement costs one or two short sleeps and synchronisations per new configuration.

  On a CPU (fake) device, the step time is measured; memory is the static bound and
  ``compute = flops / (step_time_s * peak_flops)`` against the fake device's declared peak.

Profiles are cached per (structural key, device kind) in :class:`ProfileCache` (JSON on disk).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CONTEXT_BYTES = 600 << 20  # per-process CUDA context (bytes); override with the pool's context_bytes


@dataclass
class TrialProfile:
    """Cost of one configuration on one device kind.

    Attributes:
        kind: device kind, e.g. "H200".
        memory_bytes: peak device memory of the trial's process (bytes).
        step_time_s: solo time of one training step (seconds); ``nan`` when only static.
        compute: busy fraction in (0, 1] when alone; ``nan`` when only static.
        flops: FLOPs per step (forward + backward).
        source: "cuda", "cpu" (measured) or "static" (meta-device estimate).
    """

    kind: str
    memory_bytes: int
    step_time_s: float = float("nan")
    compute: float = float("nan")
    flops: float = 0.0
    source: str = "static"

    @property
    def measured(self) -> bool:
        return self.source != "static"


def static_profile(workload, params: dict, kind: str, context_bytes: int = CONTEXT_BYTES) -> TrialProfile:
    """Meta-device estimate (see module docstring); no device memory is touched.

    Raises:
        HpoConfigError: ``params`` name parameters the workload does not have.
    """
    est = workload.estimate(params)
    mem = int(1.25 * (4 * est["param_bytes"] + 2 * est["activation_bytes"])) + int(context_bytes)
    return TrialProfile(kind=kind, memory_bytes=mem, flops=est["flops"], source="static")


class StepProfiler:
    """Measures a trial's first steps in place (see module docstring). Call ``before(step)`` and
    ``after(step)`` around every training step and ``interrupt()`` when the loop synchronises between
    steps (evaluation, checkpoint). ``result`` is set once ``window`` steps were timed.

    Args:
        device: the torch device the trial trains on.
        kind: device kind name for the profile.
        static: the static profile (memory bound and FLOPs used on CPU).
        warmup, window: steps skipped, then steps timed (warmup >= 1, window >= 1).
        peak_flops: declared peak of a fake CPU device (FLOP/s) for the compute share on CPU.
        context_bytes: CUDA context bytes added to the allocator's peak.
    Raises:
        ValueError: ``warmup < 1`` or ``window < 1``.
    """

    SLEEP_MIN_S, SLEEP_MAX_S, CLOCK_HZ = 0.002, 0.1, 1.9e9  # sleep kernel bounds; ~H100/H200 SM clock

    def __init__(self, device: torch.device, kind: str, static: TrialProfile,
                 warmup: int = 2, window: int = 5, peak_flops: float = 5e10, context_bytes: int = CONTEXT_BYTES):
        if warmup < 1 or window < 1:
            raise ValueError(f"warmup={warmup}, window={window}: expected warmup >= 1 and window >= 1")
        self.device, self.kind, self.static = device, kind, static
        self.peak_flops, self.context_bytes = peak_flops, context_bytes
        self.warmup, self.window = warmup, window
        self.cuda = device.type == "cuda"
        self.phase = "warm"     # warm -> measure -> done
        self.seen = 0           # warm-up steps seen
        self._host_warm: list[float] = []   # host seconds of warm-up steps after the first (sizes the sleep)
        self._host: list[float] = []        # host seconds of each timed step
        self._pairs: list = []              # (event before, event after) of each timed step in a clean segment
        self._arm = True                    # issue the sleep before the next timed step
        self.result: TrialProfile | None = None

    @property
    def done(self) -> bool:
        return self.result is not None

    def interrupt(self) -> None:
        """The loop synchronised the device between steps: drop that gap and re-arm the sleep."""
        self._arm = True

    def before(self, step: int) -> None:
        if self.done:
            return
        if self.phase == "warm" and self.seen >= self.warmup:
            self.phase = "measure"
            self._arm = True
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
        if self.phase == "measure" and self.cuda and self._arm:
            torch.cuda.synchronize(self.device)
            per_step = _median(self._host_warm) if self._host_warm else 0.0
            left = self.window - len(self._host)
            sleep_s = min(self.SLEEP_MAX_S, max(self.SLEEP_MIN_S, 1.5 * per_step * left))
            torch.cuda._sleep(int(sleep_s * self.CLOCK_HZ))  # the host enqueues the next steps meanwhile
            self._last = torch.cuda.Event(enable_timing=True)
            self._last.record()
        self._arm = False
        self._t = time.perf_counter()

    def after(self, step: int) -> None:
        if self.done:
            return
        host = time.perf_counter() - self._t
        if self.phase == "warm":
            self.seen += 1
            if self.seen > 1:  # the first step pays one-off costs (cuDNN plans, allocator growth)
                self._host_warm.append(host)
            return
        self._host.append(host)
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._pairs.append((self._last, ev))
            self._last = ev
        if len(self._host) < self.window:
            return
        cpu = _median(self._host)
        if self.cuda:
            self._pairs[-1][1].synchronize()
            gpu = min(a.elapsed_time(b) for a, b in self._pairs) / 1e3
            solo = max(cpu, gpu)
            self.result = TrialProfile(
                kind=self.kind, memory_bytes=int(torch.cuda.max_memory_reserved(self.device)) + self.context_bytes,
                step_time_s=solo, compute=min(1.0, max(gpu / solo, 1e-3)), flops=self.static.flops,
                source="cuda")
        else:
            self.result = TrialProfile(
                kind=self.kind, memory_bytes=self.static.memory_bytes, step_time_s=cpu,
                compute=min(1.0, max(self.static.flops / (cpu * self.peak_flops), 1e-3)),
                flops=self.static.flops, source="cpu")
        self.phase = "done"


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    return ys[len(ys) // 2]


class ProfileCache:
    """Profiles by (structural key, device kind), saved as JSON at ``path`` (None: memory only).

    Thread-safe; a later measured profile replaces an earlier one, a static one never replaces a measured one.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._data: dict[str, TrialProfile] = {}
        if self.path and self.path.exists():
            for k, v in json.loads(self.path.read_text()).items():  # null: not measured (NaN in memory)
                self._data[k] = TrialProfile(**{f: float("nan") if x is None else x for f, x in v.items()})

    @staticmethod
    def _key(structural_key: str, kind: str) -> str:
        return f"{kind}|{structural_key}"

    def get(self, structural_key: str, kind: str) -> TrialProfile | None:
        with self._lock:
            return self._data.get(self._key(structural_key, kind))

    def put(self, structural_key: str, profile: TrialProfile) -> None:
        with self._lock:
            key = self._key(structural_key, profile.kind)
            old = self._data.get(key)
            if old is not None and old.measured and not profile.measured:
                return
            self._data[key] = profile
            if self.path:
                tmp = self.path.with_suffix(".tmp")
                # strict JSON (other tools read it): an unmeasured NaN field is written as null
                doc = {k: {f: None if isinstance(x, float) and math.isnan(x) else x for f, x in asdict(v).items()}
                       for k, v in self._data.items()}
                tmp.write_text(json.dumps(doc, indent=1, allow_nan=False))
                os.replace(tmp, self.path)

    def items(self) -> list[tuple[str, TrialProfile]]:
        with self._lock:
            return list(self._data.items())
