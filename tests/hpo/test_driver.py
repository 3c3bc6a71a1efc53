"""Real end-to-end studies on 2 fake CPU devices: training, packing, trial crash, scheduler crash + resume."""

import argparse
import json
import os
import signal
import threading
import time

import optuna
import pytest
import torch
import yaml

from hpdl.hpo.cli import HpoCommand
from hpdl.hpo.driver import run_study
from hpdl.hpo.errors import HpoError
from hpdl.hpo.messages import Done, PeakMemory, ProfileReport
from hpdl.hpo.report import study_status
from hpdl.hpo.spec import StudySpec, make_storage
from hpdl.hpo.workloads import get_workload
from hpo_fixture_workloads import start_driver

FIXED = {"depth": 1, "batch_size": 16, "image_size": 8, "steps": 30, "eval_every": 10}


def spec_dict(tmp_path, **over):
    d = {"study": "t", "workload": "cnn", "n_trials": 4, "run_dir": str(tmp_path / "run"),
         "sampler": {"name": "random", "seed": 3},
         "space": {"lr": {"type": "float", "low": 0.02, "high": 0.2, "log": True},
                   "width": {"type": "categorical", "choices": [4, 8]}},
         "fixed": dict(FIXED), "pool": {"fake": 2, "memory_gb": 2},
         "policy": {"name": "pack", "max_trials_per_device": 1}}  # 2 worker processes: CI has 2 cores
    d.update(over)
    return d


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def trials_of(spec):
    return optuna.load_study(study_name=spec.study, storage=make_storage(spec.storage)).get_trials(deepcopy=False)


def write_pool(path, ids):
    path.write_text(yaml.safe_dump({"devices": [{"id": i, "kind": "cpu", "memory_gb": 2} for i in ids]}))


@pytest.mark.timeout(180)
def test_end_to_end_two_workers_elastic_pool_matches_serial_training(tmp_path, capsys):
    """A real study: one device at first, a second one added, then the first removed while it trains."""
    pool_file = tmp_path / "pool.yaml"
    write_pool(pool_file, ["fake:0"])
    # 1200 steps: the trials outlast the 0.2 s polls below (400 could end between two on an idle machine)
    spec = StudySpec.from_dict(spec_dict(tmp_path, pool={"file": str(pool_file)},
                                         fixed={**FIXED, "steps": 1200, "eval_every": 50}))
    make_storage(spec.storage)  # create the schema before two processes race to do it
    events = []

    def elastic():
        deadline = time.monotonic() + 150
        stage = 0
        while time.monotonic() < deadline and stage < 2:
            time.sleep(0.2)
            try:
                trials = trials_of(spec)
            except Exception:  # noqa: BLE001 - study not created yet
                continue
            run = [t for t in trials if t.state.name == "RUNNING"]
            on = {t.user_attrs.get("hpdl_device") for t in run if t.last_step}
            if stage == 0 and "fake:0" in on:
                write_pool(pool_file, ["fake:0", "fake:1"])
                events.append("added")
                stage = 1
            elif stage == 1 and "fake:0" in on and "fake:1" in {t.user_attrs.get("hpdl_device") for t in run}:
                write_pool(pool_file, ["fake:1"])
                events.append("removed")
                stage = 2

    th = threading.Thread(target=elastic, daemon=True)
    th.start()
    res = run_study(spec)
    th.join(5)
    assert events == ["added", "removed"]
    assert res.complete == 4 and not res.failures and res.history and res.preempted >= 1
    trials = trials_of(spec)
    assert sorted(t.state.name for t in trials) == ["COMPLETE"] * 4
    assert "fake:1" in {t.user_attrs["hpdl_device"] for t in trials}  # the added device ran trials
    assert not any(alive(t.user_attrs["hpdl_pid"]) for t in trials)
    # placement-invariance oracle: each configuration trained serially in this process gives the same value,
    # including the one preempted on the removed device and continued from its checkpoint on the other
    from test_workloads import Ctx
    torch.set_num_threads(1)
    for t in trials:
        direct = get_workload("cnn").train(Ctx({**FIXED, "steps": 1200, "eval_every": 50, **t.params}))
        assert t.value == pytest.approx(direct, abs=1e-6)
    assert (tmp_path / "run" / "profiles.json").exists()
    with pytest.raises(HpoError, match="already exists"):
        run_study(spec)
    st = study_status(spec.storage, spec.study)
    assert st["finished_configs"] == 4 and st["states"] == {"COMPLETE": 4}
    parser = argparse.ArgumentParser()
    HpoCommand.add_arguments(parser)
    args = parser.parse_args(["status", "--storage", spec.storage, "--study", spec.study, "--format", "json"])
    assert HpoCommand().run(args) == 0
    assert json.loads(capsys.readouterr().out)["best_value"] == res.best_value


@pytest.mark.timeout(120)
def test_warm_pool_is_ready_before_the_clock_and_runs_every_trial(tmp_path):
    """warm_workers: 1 per device -> two processes, started and ready before wall time counts, run all trials."""
    spec = StudySpec.from_dict(spec_dict(tmp_path, n_trials=3, warm_workers=1, policy={"name": "one_per_gpu"}))
    res = run_study(spec)
    assert res.complete == 3 and not res.failures and res.warmup_s > 0  # phases below: spawn, import, study load
    assert list(res.warmup_phases) == ["spawn", "import", "optimizer", "study", "ready"]  # no "cuda" on CPU
    assert all(0 < p["median"] <= p["max"] < res.warmup_s for p in res.warmup_phases.values())
    trials = trials_of(spec)
    # the driver asked for the first trials while the pool started, not after
    assert res.driver_s["prepare"] > 0 and min(t.datetime_start.timestamp() for t in trials) < res.started_at
    assert len({t.user_attrs["hpdl_pid"] for t in trials}) == 2
    assert all(t.user_attrs["hpdl_host"] and t.user_attrs["hpdl_started_at"] for t in trials)


@pytest.mark.timeout(120)
def test_a_failed_worker_gets_no_new_trial(tmp_path):
    """After a trial raises, its worker exits; the driver must not hand it the next trial (on the device an
    OOM was followed by a spurious 'died' failure of the trial given to the exiting worker)."""
    d = spec_dict(tmp_path, workload="hpo_fixture_workloads:RaiseOnceCNN", n_trials=2, warm_workers=1,
                  pool={"fake": 1, "memory_gb": 2}, policy={"name": "one_per_gpu"},
                  space={"lr": {"type": "float", "low": 0.02, "high": 0.2, "log": True}},
                  fixed={**FIXED, "width": 8, "crash_dir": str(tmp_path)})
    res = run_study(StudySpec.from_dict(d))
    assert res.complete == 2 and res.failures == {"error": 2}  # one per configuration, no 'died'


@pytest.mark.timeout(150)
def test_killed_trial_process_is_failed_retried_and_resumes_from_checkpoint(tmp_path):
    d = spec_dict(tmp_path, workload="hpo_fixture_workloads:CrashOnceCNN", n_trials=2,
                  policy={"name": "one_per_gpu"},
                  space={"lr": {"type": "float", "low": 0.02, "high": 0.2, "log": True}},
                  fixed={**FIXED, "width": 8, "crash_dir": str(tmp_path), "crash_at": 25})
    spec = StudySpec.from_dict(d)
    res = run_study(spec)
    assert res.failures == {"died": 2} and res.complete == 2
    trials = trials_of(spec)
    failed = [t for t in trials if t.state.name == "FAIL"]
    done = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(failed) == 2 and len(done) == 2
    assert all(t.user_attrs["hpdl_failure"].startswith("died") for t in failed)
    for t in done:  # the retry resumed from the step-20 checkpoint: it reported only step 30
        assert t.user_attrs["hpdl_attempt"] == 1
        assert sorted(t.intermediate_values) == [30]
    assert {t.user_attrs["hpdl_lineage"] for t in done} == {t.number for t in failed}
    assert not any(alive(t.user_attrs["hpdl_pid"]) for t in trials)


@pytest.mark.timeout(900)  # the bound of a hung run only: the waits below end on events, not on the clock
def test_scheduler_killed_then_resumed_loses_nothing_and_leaves_nothing_running(tmp_path):
    """With max_retries 0 a kill -9 of the driver gives up no configuration: its death is not the trials'
    failure (before: the killed trials' configurations were given up and `resume` reported done)."""
    # long enough that a trial is still running when the poll below looks (120 steps took ~0.1 s on an idle
    # machine: the whole study could end between two polls, 2 of 5 runs at 5c2d8b6)
    d = spec_dict(tmp_path, n_trials=3, max_retries=0, fixed={**FIXED, "steps": 1500, "eval_every": 10})
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(d))
    spec = StudySpec.from_dict(d)
    make_storage(spec.storage)  # create the schema before two processes race to do it
    proc = start_driver(f"StudySpec.from_yaml({str(path)!r})")
    try:
        running = []
        while proc.poll() is None:  # however loaded the machine, until a trial runs or the driver ends
            time.sleep(0.1)
            try:
                trials = trials_of(spec)
            except Exception:  # noqa: BLE001 - the study may not exist yet
                continue
            running = [t for t in trials if t.state.name == "RUNNING" and t.last_step and "hpdl_pid" in t.user_attrs]
            if running:
                break
        assert running, f"the driver ended (exit {proc.returncode}) before a trial reported a step"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    pids = {t.user_attrs["hpdl_pid"] for t in trials_of(spec) if "hpdl_pid" in t.user_attrs}
    deadline = time.monotonic() + 120  # they notice the driver's death within a second or two when idle
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "worker processes outlived the killed driver by 120 s"
    res = run_study(spec, resume=True)
    trials = trials_of(spec)
    assert not [t for t in trials if t.state.name in ("RUNNING", "WAITING")]
    lineages = {}
    for t in trials:
        if t.state.name == "COMPLETE":
            lin = t.user_attrs["hpdl_lineage"]
            assert lin not in lineages, "a configuration completed twice"
            lineages[lin] = t
    assert len(lineages) == 3 and not any(t.user_attrs.get("hpdl_gave_up") for t in trials)
    assert res.requeued.get("driver_died", 0) >= 1 and not res.failures
    # the killed driver's trials went back to WAITING and ran again as the same trials: one trial per
    # configuration, no FAIL for the kill (issue 37)
    assert len(trials) == 3 and {t.state.name for t in trials} == {"COMPLETE"}
    died = [t for t in trials if any(r.startswith("driver_died") for r in t.user_attrs.get("hpdl_requeued", []))]
    assert died and all(t.user_attrs.get("hpdl_attempt", 0) == 0 for t in died)


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    from test_mps import FAKE

    exe = tmp_path / "bin" / "nvidia-cuda-mps-control"
    exe.parent.mkdir()
    exe.write_text(FAKE)
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.timeout(120)
def test_mps_start_gives_workers_the_daemon_and_stops_it(tmp_path, fake_mps):
    """``mps: start`` end to end without a GPU (a stand-in control program; the pool is marked as CUDA so
    the driver starts the daemon): every worker sees the daemon's pipe folder, the policy uses its MPS rule,
    the daemon is gone after the study, and wall time ends before the teardown."""
    from hpdl.hpo.driver import Driver
    from hpdl.hpo.mps import daemon_pid
    from hpdl.runtime.procs import pid_alive as _alive

    d = spec_dict(tmp_path, n_trials=2, mps="start", workload="hpo_fixture_workloads:EnvRecordingCNN",
                  fixed={**FIXED, "crash_dir": str(tmp_path)})
    drv = Driver(StudySpec.from_dict(d))
    drv._cuda = True  # as on a GPU pool
    seen = {}
    orig = Driver._start_mps

    def spy(self):
        orig(self)
        seen["pid"] = daemon_pid(self.mps_daemon.pipe_dir)
        seen["pipe"] = str(self.mps_daemon.pipe_dir)

    Driver._start_mps = spy
    try:
        t0 = time.monotonic()
        res = drv.run()
        total = time.monotonic() - t0
    finally:
        Driver._start_mps = orig
    assert res.complete == 2 and drv.policy.mps is True
    assert {open(tmp_path / f"env-{k}").read() for k in range(2)} == {seen["pipe"]}
    assert not _alive(seen["pid"])
    assert res.teardown_s > 0 and res.wall_s + res.warmup_s + res.teardown_s <= total + 0.01


@pytest.mark.timeout(60)
def test_mps_daemon_is_stopped_when_the_warm_pool_fails(tmp_path, fake_mps):
    from hpdl.hpo.driver import Driver
    from hpdl.hpo.mps import daemon_pid
    from hpdl.runtime.procs import pid_alive as _alive

    drv = Driver(StudySpec.from_dict(spec_dict(tmp_path, mps="start")))
    assert drv.policy.mps is False and drv.mps_daemon is None
    drv._start_mps()
    assert drv.mps_daemon is None   # fake CPU devices: nothing to start
    drv._cuda = True
    pids = []

    def broken(devices, limit_s, idle=None):
        pids.append(daemon_pid(drv.mps_daemon.pipe_dir))
        raise HpoError("warm worker on fake:0 died during start-up (exit code 1)")

    drv.launcher.warm_up = broken
    with pytest.raises(HpoError, match="warm worker"):
        drv.run()
    assert pids[0] is not None and not _alive(pids[0]) and drv.policy.mps is True


@pytest.mark.timeout(60)
def test_trials_asked_while_the_pool_started_are_released_when_it_fails(tmp_path):
    """The driver asks for its first trials while the pool starts; if the pool then fails they must not stay
    RUNNING in the storage: each goes back to WAITING (not_started, no attempt used) for a resume."""
    from hpdl.hpo.driver import Driver

    drv = Driver(StudySpec.from_dict(spec_dict(tmp_path, n_trials=4)))

    def broken(devices, limit_s, idle=None):
        while idle():
            pass
        raise HpoError("warm worker on fake:0 died during start-up (exit code 1)")

    drv.launcher.warm_up = broken
    with pytest.raises(HpoError, match="warm worker"):
        drv.run()
    trials = drv.study.get_trials(deepcopy=False)
    states = sorted(t.state.name for t in trials)
    assert states == ["WAITING"] * 4  # the same four trials wait to run, none FAIL (issue 37)
    assert all(t.user_attrs["hpdl_requeued"][-1].startswith("not_started") for t in trials)
    assert all(t.user_attrs.get("hpdl_attempt", 0) == 0 for t in trials)
    assert not drv.ledger.failures


@pytest.mark.timeout(60)
def test_first_trials_start_before_every_static_estimate_is_done(tmp_path, monkeypatch):
    """A deep lookahead of new structures must not delay the first dispatch: estimates beyond the per-tick
    budget wait for the next tick."""
    import hpdl.hpo.asking as asking
    import hpdl.hpo.placement as placement
    from hpdl.hpo.driver import Driver

    space = {"width": {"type": "categorical", "choices": [4, 5, 6, 7, 8, 9, 10, 11]}}
    drv = Driver(StudySpec.from_dict(spec_dict(tmp_path, n_trials=8, space=space, lookahead=8)))
    monkeypatch.setattr(asking, "_SAMPLE_BUDGET_S", 60.0)
    drv._sample(set(), set())
    assert len(drv.pending) == 8
    monkeypatch.setattr(placement, "_ESTIMATE_BUDGET_S", 0.0)   # one estimate per tick at most
    structures = lambda demands: {t.skey for t in drv.pending if t.number in demands}  # noqa: E731
    assert len({t.skey for t in drv.pending}) >= 3
    assert len(structures(drv.placement.demands(drv.pool.devices()))) == 1
    assert len(structures(drv.placement.demands(drv.pool.devices()))) == 2   # the cached one plus one new
    monkeypatch.setattr(placement, "_ESTIMATE_BUDGET_S", 60.0)
    assert len(drv.placement.demands(drv.pool.devices())) == 8
    drv.shutdown()


@pytest.mark.timeout(60)
def test_sampling_stops_after_its_budget_once_a_trial_is_pending(tmp_path, monkeypatch):
    """The first trials start before the whole lookahead is asked for (each ask is several storage commits):
    past the per-tick budget the rest waits for the next tick, which does not wait for a message."""
    import hpdl.hpo.asking as asking
    from hpdl.hpo.driver import Driver

    drv = Driver(StudySpec.from_dict(spec_dict(tmp_path, n_trials=8, lookahead=8)))
    monkeypatch.setattr(asking, "_SAMPLE_BUDGET_S", 0.0)
    drv._sample(set(), set())
    assert len(drv.pending) == 1 and drv.asker.short
    drv._sample(*drv.ledger.lineages())
    assert len(drv.pending) == 2 and drv.asker.short
    monkeypatch.setattr(asking, "_SAMPLE_BUDGET_S", 60.0)
    drv._sample(*drv.ledger.lineages())
    assert len(drv.pending) == 8 and drv.asker.short  # what this tick sampled is placed without waiting
    assert drv.ledger.lineages()[1] == {t.number for t in drv.pending}
    drv._sample(*drv.ledger.lineages())
    assert len(drv.pending) == 8 and not drv.asker.short  # nothing new: the next tick waits for messages
    drv.shutdown()


@pytest.mark.timeout(60)
def test_configurations_a_user_enqueued_use_the_budget_and_stop_the_asks(tmp_path, monkeypatch):
    """Optuna's ask pops enqueued trials first; a user's enqueued configuration is a lineage of its own,
    and once the budget is used no new configuration is asked, whatever the lookahead."""
    import hpdl.hpo.asking as asking
    from hpdl.hpo.driver import Driver

    monkeypatch.setattr(asking, "_SAMPLE_BUDGET_S", 60.0)
    drv = Driver(StudySpec.from_dict(spec_dict(tmp_path, n_trials=2, lookahead=8)))
    drv.study.enqueue_trial({"width": 4, "lr": 0.05})
    drv.study.enqueue_trial({"width": 8, "lr": 0.05})
    drv._sample(*drv.ledger.lineages())
    assert [t.params["width"] for t in drv.pending] == [4, 8] and drv.ledger.waiting == 0
    drv.shutdown()


@pytest.mark.timeout(60)
def test_drivers_sharing_one_storage_never_ask_past_the_budget(tmp_path, monkeypatch):
    """Many nodes: two drivers on one store and study. A driver whose budget limits its asks counts the
    other driver's configurations from the storage, however recent."""
    import hpdl.hpo.asking as asking
    from hpdl.hpo.driver import Driver

    monkeypatch.setattr(asking, "_SAMPLE_BUDGET_S", 60.0)
    monkeypatch.setattr(asking, "_BUDGET_READ_S", 0.0)  # this test's steps may take less than 50 ms
    d = spec_dict(tmp_path, n_trials=4, lookahead=2, storage=f"sqlite:///{tmp_path}/shared.db")
    a = Driver(StudySpec.from_dict(d))
    b = Driver(StudySpec.from_dict({**d, "run_dir": str(tmp_path / "node-b")}), resume=True)  # another node
    try:
        a._sample(*a.ledger.lineages())   # a: configurations 0 and 1
        b._sample(*b.ledger.lineages())   # b: 2 and 3, the whole budget
        for t in list(a.pending):         # a's two finish (what the loop does on "done")
            a.pending.remove(t)
            a._on_message(type("W", (), {"trial": t, "idle_since": 0})(), Done(trial_id=t.trial_id, value=0.5))
        a._sample(*a.ledger.lineages())   # within refresh_s of a's last read
        assert not a.pending
        assert len({t.user_attrs["hpdl_lineage"] for t in a.study.get_trials()}) == 4
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.timeout(60)
def test_a_driver_that_sees_another_reads_the_store_before_each_ask(tmp_path, monkeypatch):
    """A resumed driver (or one whose read found configurations it did not ask for) counts from the store
    before it asks, even when its lookahead, not the budget, limits the asks."""
    import hpdl.hpo.asking as asking
    from hpdl.hpo.driver import Driver

    monkeypatch.setattr(asking, "_SAMPLE_BUDGET_S", 60.0)
    monkeypatch.setattr(asking, "_BUDGET_READ_S", 0.0)
    d = spec_dict(tmp_path, n_trials=5, lookahead=2, storage=f"sqlite:///{tmp_path}/shared.db")
    a = Driver(StudySpec.from_dict(d))
    b = Driver(StudySpec.from_dict({**d, "run_dir": str(tmp_path / "node-b")}), resume=True)  # another node
    try:
        a._sample(*a.ledger.lineages())   # a: 0, 1 (alone so far)
        b._sample(*b.ledger.lineages())   # b saw a's: reads first, asks 2, 3
        assert b.ledger.shared and not a.ledger.shared
        for t in list(a.pending):
            a.pending.remove(t)
            a._on_message(type("W", (), {"trial": t, "idle_since": 0})(), Done(trial_id=t.trial_id, value=0.5))
        a.ledger.refresh_s = 0.0          # a's next periodic read (within 2 s in the driver)
        a._sample(*a.ledger.lineages())
        assert a.ledger.shared and len(a.pending) == 1
        assert len({t.user_attrs["hpdl_lineage"] for t in a.study.get_trials()}) == 5
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.timeout(120)
def test_nan_objective_fails_its_configuration_once_and_the_study_finishes(tmp_path):
    """Optuna stores a NaN objective as FAIL: the configuration is finished as failed (``nan``, not
    retried, not replaced by a new one) and the driver's counts match the storage."""
    from hpdl.hpo.driver import Driver

    d = spec_dict(tmp_path, workload="hpo_fixture_workloads:NanCNN", n_trials=3, max_retries=2,
                  fixed={**FIXED, "steps": 10})
    drv = Driver(StudySpec.from_dict(d))
    try:
        res = drv.run()
    finally:
        drv.shutdown()
    states = sorted(t.state.name for t in drv.study.get_trials())
    assert res.failures == {"nan": states.count("FAIL")} and res.complete == states.count("COMPLETE")
    assert len(states) == 3 and res.failures["nan"] >= 1 and res.complete + res.failures["nan"] == 3
    mem = tuple(set(x) for x in drv.ledger.lineages())
    assert mem == drv.ledger.lineages(max_age_s=0.0) == ({0, 1, 2}, set())


@pytest.mark.timeout(120)
def test_study_finishes_when_estimates_and_asks_trickle_in_one_per_tick(tmp_path, monkeypatch):
    """The loop places trials whose demand is known while others still wait for their estimate or their
    ask; the result splits the driver's time by phase."""
    import hpdl.hpo.asking as asking
    import hpdl.hpo.placement as placement

    monkeypatch.setattr(placement, "_ESTIMATE_BUDGET_S", 0.0)
    monkeypatch.setattr(asking, "_SAMPLE_BUDGET_S", 0.0)
    space = {"width": {"type": "categorical", "choices": [4, 5, 6, 7]}}
    res = run_study(StudySpec.from_dict(spec_dict(tmp_path, n_trials=4, space=space, lookahead=4)))
    assert res.complete == 4 and not res.failures
    assert set(res.driver_s) <= {"other", "wait", "messages", "ledger", "place", "sample"}
    assert {"wait", "place", "sample"} <= set(res.driver_s) and res.driver_s["sample"] > 0
    assert sum(res.driver_s.values()) <= res.wall_s + 0.05


@pytest.mark.timeout(60)
def test_tasks_carry_the_memory_cap_and_whole_run_peaks_raise_profiles(tmp_path):
    """The driver hands the policy's cap to the worker, and a trial's whole-run peak (an evaluation may
    need more than the profiled training steps) replaces its configuration's profile only upwards."""
    from types import SimpleNamespace

    from hpdl.hpo.driver import Driver
    from hpdl.hpo.profiler import TrialProfile
    from hpdl.hpo.policies import GIB, TrialDemand

    drv = Driver(StudySpec.from_dict(spec_dict(tmp_path, n_trials=2, pool={"fake": 1, "memory_gb": 40})))
    try:
        drv._sample(set(), set())
        t, dev = drv.pending[0], drv.pool.devices()[0]
        t.demand = TrialDemand(t.number, 5 * GIB, 0.5, 1.0, profiled=True)
        assert drv.placement.task(t, dev).memory_cap == 5 * GIB
        t.demand = TrialDemand(t.number, GIB, 0.5, 1.0, profiled=True)
        assert drv.placement.task(t, dev).memory_cap is None  # small trials stay uncapped
        w = SimpleNamespace(trial=t)
        drv.profiles.put(t.skey, TrialProfile("H200", GIB))  # static only: not a measurement to raise
        drv._on_message(w, PeakMemory(trial_id=t.trial_id, kind="H200", bytes=3 * GIB))
        assert drv.profiles.get(t.skey, "H200").memory_bytes == GIB
        drv.profiles.put(t.skey, TrialProfile("cpu", GIB, 0.01, 0.5, source="cpu"))
        drv._on_message(w, PeakMemory(trial_id=t.trial_id, kind="cpu", bytes=3 * GIB))
        assert drv.profiles.get(t.skey, "cpu").memory_bytes == 3 * GIB
        assert w.trial is t and drv.running.get(t.number, t) is t  # not an outcome: the trial runs on
        drv._on_message(w, PeakMemory(trial_id=t.trial_id, kind="cpu", bytes=2 * GIB))
        assert drv.profiles.get(t.skey, "cpu").memory_bytes == 3 * GIB
        drv._on_message(w, PeakMemory(trial_id=t.trial_id + 1, kind="cpu", bytes=9 * GIB))  # another trial's late message
        assert drv.profiles.get(t.skey, "cpu").memory_bytes == 3 * GIB
        # a sibling's profile of the training steps alone must not undo the whole-run peak
        drv._on_message(w, ProfileReport(trial_id=t.trial_id, profile={"kind": "cpu", "memory_bytes": GIB, "step_time_s": 0.01,
                                                    "compute": 0.5, "source": "cpu"}))
        assert drv.profiles.get(t.skey, "cpu").memory_bytes == 3 * GIB and t.demand.memory_bytes == 3 * GIB
        # the policy learns step times (its run-time estimates) and demands carry the steps to scale them
        drv._on_message(w, ProfileReport(trial_id=t.trial_id, profile={"kind": "cpu", "memory_bytes": GIB, "step_time_s": 0.02,
                                                    "compute": 0.5, "source": "cpu", "flops": 1e9}))
        assert (0.02, 1e9) in drv.policy._step_times and t.demand.steps > 0
        assert all(d.steps > 0 for d in drv.placement.demands(drv.pool.devices()).values())
    finally:
        drv.shutdown()


@pytest.mark.timeout(60)
def test_outcome_sent_just_before_the_worker_exits_is_not_a_death(tmp_path):
    """A worker (or Ray task) may send ``done`` and exit between the tick that read its channel and the
    reaping: the outcome in its channel wins over "died" (the Ray packing test flaked on this under load)."""
    from types import SimpleNamespace

    from hpdl.hpo.driver import Driver
    from hpdl.hpo.launch import WorkerHandle

    drv = Driver(StudySpec.from_dict(spec_dict(tmp_path, n_trials=1)))
    try:
        drv._sample(set(), set())
        t = drv.pending.pop(0)
        parent, child = __import__("multiprocessing").Pipe()
        child.send(Done(trial_id=t.trial_id, value=0.75))
        child.close()  # the worker is gone
        w = WorkerHandle(SimpleNamespace(is_alive=lambda: False, exitcode=0, join=lambda *a: None), parent, "fake:0")
        w.trial, t.worker, t.device_id = t, w, "fake:0"
        drv.running[t.number] = t
        drv.launcher.workers.append(w)
        drv._reap()
        assert not drv.running and not drv.ledger.failures and w not in drv.workers
        assert drv.study.trials[t.number].value == 0.75
    finally:
        drv.shutdown()


@pytest.mark.timeout(150)
def test_grid_study_runs_each_point_once_and_survives_the_samplers_retry_error(tmp_path):
    """n_trials beyond the grid is refused (Optuna's grid repeats points); a failed grid point's retry is an
    enqueued trial, whose tell makes GridSampler.after_trial raise KeyError once one point is left: the
    trial's state is stored first, so the driver logs it and finishes every point exactly once."""
    from hpdl.hpo.errors import HpoConfigError

    grid = {"width": {"type": "categorical", "choices": [4, 8]}}
    with pytest.raises(HpoConfigError, match="n_trials=3 with sampler grid: expected <= 2"):
        StudySpec.from_dict(spec_dict(tmp_path, n_trials=3, sampler={"name": "grid"}, space=grid))
    d = spec_dict(tmp_path, workload="hpo_fixture_workloads:RaiseOnceCNN", n_trials=2, max_retries=1,
                  sampler={"name": "grid"}, space=grid, fixed={**FIXED, "steps": 10, "crash_dir": str(tmp_path)})
    res = run_study(StudySpec.from_dict(d))
    trials = trials_of(StudySpec.from_dict({**d, "study": "t"}))
    assert res.complete == 2 and res.failures == {"error": 2}
    assert sorted(t.params["width"] for t in trials if t.state.name == "COMPLETE") == [4, 8]


def test_ledger_tell_turns_a_samplers_stop_into_stop_requested():
    """GridSampler calls study.stop() from after_trial once its last point is told, which raises outside
    Study.optimize after the state was stored; an error before the state is stored still raises."""
    from hpdl.hpo.ledger import Ledger

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s = optuna.create_study(sampler=optuna.samplers.GridSampler({"x": [1]}))
    lg = Ledger(s, 0, "h")
    t = s.ask({"x": optuna.distributions.CategoricalDistribution([1])})
    ft = lg.tell(t.number, 0.5, optuna.trial.TrialState.COMPLETE)
    assert lg.stop_requested and ft.state == optuna.trial.TrialState.COMPLETE and ft.value == 0.5
    t2 = s.ask({"x": optuna.distributions.CategoricalDistribution([1])})
    with pytest.raises(ValueError):  # a NaN cannot complete: nothing stored, the error is the caller's
        lg.tell(t2.number, float("nan"), optuna.trial.TrialState.COMPLETE)
