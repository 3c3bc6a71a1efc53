"""The driver's parts work alone, from what they are given (no Driver): the asker keeps the lookahead and the
budget, the fault handler ends trials as their messages say and reaps dead workers."""

from types import SimpleNamespace

import optuna
import pytest

from hpdl.hpo import messages
from hpdl.hpo.asking import Asker
from hpdl.hpo.errors import HpoError
from hpdl.hpo.faults import FaultHandler
from hpdl.hpo.launch import WorkerHandle
from hpdl.hpo.ledger import Ledger
from hpdl.hpo.runs import TrialQueue, TrialRun
from hpdl.hpo.spec import make_storage

SPACE = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}


class _Workload:
    fuse_vary = ()

    @staticmethod
    def structural_key(params):
        return "k"


@pytest.fixture
def store(tmp_path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = make_storage(f"sqlite:///{tmp_path / 'study.db'}")
    study = optuna.create_study(study_name="parts", storage=storage,
                                sampler=optuna.samplers.RandomSampler(seed=0))
    return study, storage, Ledger(study, 1, "h", storage=storage)


def test_asker_fills_the_lookahead_within_the_budget(store, monkeypatch):
    import hpdl.hpo.asking as asking

    monkeypatch.setattr(asking, "_SAMPLE_BUDGET_S", 60.0)  # asks per call are limited by time: not here
    study, _, ledger = store
    queue = TrialQueue()
    asker = Asker(study, SPACE, ledger, queue, _Workload(), {}, n_trials=3)
    assert asker.want(per_device=4, n_devices=2) == 8 and Asker(study, SPACE, ledger, queue, _Workload(), {}, 3,
                                                               lookahead=5).want(4, 2) == 5
    asker.ask(*ledger.lineages(), want=2)
    assert [t.number for t in queue.pending] == [0, 1] and asker.short
    asker.ask(*ledger.lineages(), want=8)  # the budget (3 configurations), not the lookahead, stops it
    assert len(queue.pending) == 3 and {t.lineage for t in queue.pending} == {0, 1, 2}
    asker.ask(*ledger.lineages(), want=8)
    assert len(queue.pending) == 3 and not asker.short  # nothing asked: the next tick may wait


class _Launcher:
    def __init__(self):
        self.workers = []

    def stop_idle(self, devices_by_id):
        pass

    def connect(self):
        pass


class _Proc:
    def __init__(self, alive=True):
        self.alive, self.exitcode = alive, None if alive else 1

    def is_alive(self):
        return self.alive

    def join(self, timeout=None):
        pass

    def kill(self):
        self.alive = False


def _handler(store, grown, values):
    study, _, ledger = store
    queue, launcher = TrialQueue(), _Launcher()
    placement = SimpleNamespace(grow_after_oom=grown.append)
    faults = FaultHandler(queue, ledger, launcher, placement, on_message=lambda w, m: None,
                          on_value=values.append, pool_ids=lambda: {"d0"}, study_name="parts",
                          checkpoint_dir="/ckpt")
    return faults, queue, launcher, ledger


def _running(study, ledger, queue, launcher, proc=None) -> tuple[TrialRun, WorkerHandle]:
    trial = study.ask(SPACE)
    t = TrialRun(trial.number, ledger.trial_id(trial.number), trial.number, dict(trial.params), "k", 0.0, "d0")
    w = WorkerHandle(proc or _Proc(), None, "d0", ready=True, trial=t)
    t.worker = w
    queue.running[t.number] = t
    launcher.workers.append(w)
    return t, w


def test_fault_handler_ends_trials_as_their_messages_say(store):
    study, _, _ = store
    grown, values = [], []
    faults, queue, launcher, ledger = _handler(store, grown, values)
    t, w = _running(study, ledger, queue, launcher)
    faults.outcome(w, t, messages.Done(trial_id=t.trial_id, value=0.5))
    assert values == [0.5] and not queue.running and w.trial is None and study.trials[t.number].value == 0.5

    t, w = _running(study, ledger, queue, launcher)  # an OOM: the profile grows, the configuration is retried
    faults.outcome(w, t, messages.Failed(trial_id=t.trial_id, kind="oom", message="CUDA out of memory"))
    assert grown == [t] and w.stopping and ledger.failures == {"oom": 1}
    assert study.trials[-1].state.name == "WAITING" and study.trials[-1].user_attrs["hpdl_attempt"] == 1

    t, w = _running(study, ledger, queue, launcher)  # preempted: back to pending, first
    faults.outcome(w, t, messages.Halted(trial_id=t.trial_id))
    assert queue.pending == [t] and faults.preempted == 1 and t.worker is None

    t, w = _running(study, ledger, queue, launcher)  # the checkpoint folder broke: re-queued, the study stops
    faults.outcome(w, t, messages.Failed(trial_id=t.trial_id, kind="checkpoint_write", message="OSError: read-only"))
    assert isinstance(faults.fatal, HpoError) and "/ckpt" in str(faults.fatal)
    assert study.trials[t.number].state.name == "WAITING" and ledger.failures == {"oom": 1}


def test_fault_handler_reaps_a_dead_worker_and_leaves_a_device_out(store):
    study, _, _ = store
    faults, queue, launcher, ledger = _handler(store, [], [])
    t, w = _running(study, ledger, queue, launcher, _Proc(alive=False))
    faults.reap({})
    assert not launcher.workers and not queue.running and ledger.failures == {"died": 1}
    for n in range(3):  # workers that die starting: the third leaves the pool's only device out
        launcher.workers.append(WorkerHandle(_Proc(alive=False), None, "d0"))
        if n < 2:
            faults.reap({})
    with pytest.raises(HpoError, match="every device's workers die during start-up"):
        faults.reap({})
    assert faults.broken == {"d0"}
