"""Asking the sampler for trials: :class:`Asker` keeps the driver's lookahead of pending trials full while
the budget allows, a little per loop tick.

Budget: ``n_trials`` configurations ("lineages"). A new configuration spends one; a retry (an enqueued
trial with the user attributes ``hpdl_lineage``/``hpdl_attempt``) or a trial re-queued as WAITING after
an interrupt does not. Optuna's ``ask`` pops WAITING trials first.
"""

from __future__ import annotations

import time

from hpdl.hpo.grouping import FuseOptions
from hpdl.hpo.runs import TrialQueue, TrialRun

_SAMPLE_BUDGET_S = 0.05  # asks per loop tick after the first (each is ~6 storage commits): start early
_BUDGET_READ_S = 0.05  # when the budget limits the asks, count from a storage read at most this old


class Asker:
    """Adds asked trials to ``queue.pending``.

    Args:
        study: the ``optuna.Study`` (asks, and ``enqueue_trial`` for same-shape asks).
        dists: the search space, ``{name: optuna distribution}``.
        ledger: the study's :class:`hpdl.hpo.ledger.Ledger` (budget counts, WAITING trials, trial ids).
        queue: the driver's :class:`hpdl.hpo.runs.TrialQueue`.
        workload: the study's workload (structural keys; ``fuse_vary`` for same-shape asks).
        fixed: the study's fixed parameters.
        n_trials: the budget, in configurations.
        lookahead: pending trials to keep (0: from the policy's concurrency, see :meth:`ask`).
        fuse: the study's fusion options, or None.
    """

    def __init__(self, study, dists: dict, ledger, queue: TrialQueue, workload, fixed: dict, n_trials: int,
                 lookahead: int = 0, fuse: FuseOptions | None = None):
        self.study, self.dists, self.ledger, self.queue = study, dists, ledger, queue
        self.workload, self.fixed, self.n_trials, self.lookahead, self.fuse = workload, fixed, n_trials, lookahead, fuse
        self.short = False  # the last call asked for trials or stopped at its time budget: place without waiting
        self._shape: tuple[dict | None, int] = (None, 0)  # same-shape asks: the batch's parameters, asks left

    def want(self, per_device: int, n_devices: int) -> int:
        """The lookahead: ``lookahead``, else enough to fill every device up to ``per_device`` trials (at least
        2, at most :data:`hpdl.hpo.launch.WARM_MAX`), times ``max_trials`` when fusing (groups to fill)."""
        from hpdl.hpo.launch import WARM_MAX

        return self.lookahead or max(2, min(WARM_MAX, per_device)) * max(1, n_devices) * (
            self.fuse.max_trials if self.fuse else 1)

    def ask(self, finished: set[int], active: set[int], want: int) -> None:
        """Ask the sampler for trials until ``want`` are pending or the budget (``n_trials`` less the
        ``finished`` and ``active`` lineages) is used. Stop after ``_SAMPLE_BUDGET_S`` (one ask at least) and
        go on at the next call, so the first trials start without waiting for the whole lookahead (30 asks
        took about 0.5 s before the first trial started on an H200 host, 2026-11-30); :attr:`short` says so."""
        pending = self.queue.pending
        self.short = False
        if len(pending) >= want:
            return
        budget = 0 if self.ledger.stop_requested else self.n_trials - len(finished) - len(active)
        if budget > 0 and (self.ledger.shared or budget <= want - len(pending)):
            # others ask too (many nodes, resume), or the budget, not the lookahead, limits the asks: count
            # from the storage
            finished, active = self.ledger.lineages(_BUDGET_READ_S)
            budget = 0 if self.ledger.stop_requested else self.n_trials - len(finished) - len(active)
        waiting = self.ledger.waiting
        deadline, asked = time.monotonic() + _SAMPLE_BUDGET_S, False
        while len(pending) < want and (budget > 0 or waiting > 0):
            if asked and time.monotonic() > deadline:  # one ask a call at least
                self.short = True  # the next tick goes on asking without waiting for a message
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
            skey = self.workload.structural_key({**self.fixed, **trial.params})
            pending.append(TrialRun(trial.number, self.ledger.trial_id(trial.number), lin, dict(trial.params),
                                    skey, time.monotonic(), attempt=int(trial.user_attrs.get("hpdl_attempt", 0))))
            asked = True
        self.short = asked  # place what this call asked for without waiting for a message

    def _shape_ask(self) -> bool:
        """``fuse: {same_shape_asks: true}``: fix the shape of the next ask to that of the last new one while
        its batch (``max_trials``) is not full: ``enqueue_trial`` with the parameters outside ``fuse_vary``, so
        the sampler (TPE, random) chooses only the others and the trials can be fused. True if it did."""
        params, left = self._shape
        if self.fuse is None or not self.fuse.same_shape_asks or not params or left <= 0:
            return False
        self.study.enqueue_trial(params, skip_if_exists=False)  # the ask that follows pops it
        return True

    def _shape_asked(self, params: dict, shaped: bool) -> None:
        """Count a new configuration in the current same-shape batch, or start a batch with its shape."""
        if self.fuse is None or not self.fuse.same_shape_asks:
            return
        if shaped:
            self._shape = (self._shape[0], self._shape[1] - 1)
        else:
            self._shape = ({k: v for k, v in params.items() if k not in self.workload.fuse_vary},
                           self.fuse.max_trials - 1)
