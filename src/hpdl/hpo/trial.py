"""What a workload's training loop sees of its trial: :class:`TrialContext` (parameters, device, reports to the
driver, pruning, checkpoints), and the per-process memory cap a trial runs under. Used by the worker for one
trial and by :mod:`hpdl.hpo.fusion` for each member of a fused group."""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

from hpdl.hpo import checkpoint, messages
from hpdl.hpo.errors import Preempted


class TrialContext:
    """What a workload's training loop sees of its trial (Optuna-like).

    Attributes:
        params: resolved parameters (search space sample + fixed values).
        device: ``torch.device`` to train on.
        number: Optuna trial number; ``lineage`` is the number of the configuration's first attempt.
        checkpoint_every: evaluations between checkpoints (0 = never).
    """

    def __init__(self, trial, params: dict, device, conn, task: dict, run_dir: Path, checkpoint_every: int,
                 profiler=None, parent_pid: int | None = None):
        self._trial, self._conn, self._task = trial, conn, task
        self.params, self.device = params, device
        self.number, self.lineage = task.number, task.lineage
        self.checkpoint_every = checkpoint_every
        self._ckpt = Path(task.checkpoint_dir) / f"lineage-{self.lineage}.pt"
        self._meta = {"study_uid": task.study_uid, "lineage": self.lineage, "params": dict(params)}
        self._profiler = profiler
        self._parent = parent_pid
        self.state_fn = None  # set by the training loop: step -> checkpoint state, used on preemption

    @property
    def trial(self):
        """The ``optuna.trial.Trial`` itself (what an Optuna objective receives)."""
        return self._trial

    def report(self, value: float, step: int) -> None:
        """Record an intermediate ``value`` at ``step`` (Optuna's order: value, then step)."""
        if self._profiler is not None:
            self._profiler.interrupt()  # evaluation synchronised the device
        with warnings.catch_warnings():
            # a trial re-queued after an interrupt keeps its values: a step reported before the stop and
            # reached again from an older checkpoint is kept as first reported (Optuna warns and ignores it)
            warnings.filterwarnings("ignore", message="The reported value is ignored because", category=UserWarning)
            self._trial.report(float(value), int(step))

    def should_prune(self) -> bool:
        """The study's pruner decision for the latest reported value."""
        return self._trial.should_prune()

    @contextlib.contextmanager
    def step(self, step: int):
        """Wrap one training step: profiling windows, preemption and parent-death checks."""
        if self._parent is not None and os.getppid() != self._parent:
            os._exit(3)  # the driver died: never leave a trial running
        if self._conn is not None and self._conn.poll():
            msg = messages.check(self._conn.recv())
            if isinstance(msg, (messages.Preempt, messages.Stop)):
                if self.state_fn is not None and self.checkpoint_every:
                    self.save_checkpoint(self.state_fn(step))  # nothing is lost: continue from this step
                raise Preempted(f"trial {self.number} preempted at step {step}",
                                stop=isinstance(msg, messages.Stop))
        if self._profiler is not None:
            self._profiler.before(step)
        yield
        if self._profiler is not None:
            self._profiler.after(step)
            if self._profiler.done:
                from dataclasses import asdict
                res = self._profiler.result
                self._conn.send(messages.ProfileReport(trial_id=self._task.trial_id, profile=asdict(res)))
                if self._task.memory_cap and self.device.type == "cuda":
                    # the driver plans with the measured peak from now on: hold the trial to it
                    cap_memory(self.device, min(int(self._task.memory_cap), res.memory_bytes),
                               int(self._task.context_bytes))
                self._profiler = None

    def load_checkpoint(self) -> dict | None:
        """The configuration's latest checkpoint (any earlier attempt of this study's lineage), or None.

        Raises:
            hpdl.hpo.checkpoint.CheckpointMismatch: the file was written for another study, lineage or
                parameters (the trial then fails for good: see :mod:`hpdl.hpo.checkpoint`).
        """
        return checkpoint.load(self._ckpt, self._meta, map_location=self.device)

    def save_checkpoint(self, state: dict) -> None:
        """Write ``state`` atomically (temporary file, then rename), with the trial's owner record."""
        checkpoint.save(self._ckpt, state, self._meta)


def cap_memory(device, cap_bytes: int | None, context_bytes: int = 0) -> None:
    """Hold this process's caching allocator on ``device`` to ``cap_bytes - context_bytes`` (bytes;
    ``None``: the whole device), with ``torch.cuda.set_per_process_memory_fraction``. An allocation over
    the cap first frees cached blocks, then raises ``torch.cuda.OutOfMemoryError``, which cuDNN takes as
    "try an algorithm with a smaller workspace". The cap counts reserved bytes, as profiles do."""
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    frac = 1.0 if not cap_bytes else min(1.0, max(cap_bytes - context_bytes, 64 << 20) / total)
    torch.cuda.set_per_process_memory_fraction(frac, device)


class LocalTrial:
    """A trial run outside the driver (a script, a notebook, a test, the fused-vs-alone check): the context a
    workload's ``train(ctx)`` reads, kept in memory, as :class:`TrialContext` offers it under the driver.

    Args:
        params: resolved parameters (the search space's sample and the fixed values).
        device: where to train (``torch.device`` or its name).
        checkpoint_every: save a checkpoint every this many evaluations into ``store["ckpt"]`` (0: none); a
            later ``LocalTrial`` given the same ``store`` resumes from it.
        store: the dict that holds the checkpoint (default: a new one).

    Attributes:
        reports: ``[(step, value)]``, every evaluation; the trial is never pruned.
        losses: every step's training loss (0-d tensors), as the shipped workloads and fused groups record it.
    """

    lineage = 0

    def __init__(self, params: dict, device="cpu", *, checkpoint_every: int = 0, store: dict | None = None):
        import torch

        self.params, self.device = params, torch.device(device)
        self.checkpoint_every = checkpoint_every
        self.store = store if store is not None else {}
        self.reports: list[tuple[int, float]] = []
        self.losses: list = []

    def report(self, value: float, step: int) -> None:
        self.reports.append((step, value))

    def should_prune(self) -> bool:
        return False

    @contextlib.contextmanager
    def step(self, step: int):
        yield

    def load_checkpoint(self) -> dict | None:
        import copy

        return copy.deepcopy(self.store.get("ckpt"))

    def save_checkpoint(self, state: dict) -> None:
        import copy

        self.store["ckpt"] = copy.deepcopy(state)  # the state dicts hold the live tensors
