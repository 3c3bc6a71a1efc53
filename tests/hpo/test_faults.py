"""Issue 20's hostile-user cases: two studies in one run folder, a second driver on a live study, SIGINT with
busy workers, unwritable folders, a study in which everything failed."""

import argparse
import os
import subprocess
import sys
import signal
import time

import pytest
import torch
import yaml

from hpdl.hpo import checkpoint
from hpdl.hpo.cli import HpoCommand
from hpdl.hpo.driver import Driver, run_study
from hpdl.hpo.errors import HpoError
from hpdl.hpo.spec import StudySpec
from hpo_fixture_workloads import start_cli
from test_driver import FIXED, spec_dict, trials_of


@pytest.mark.timeout(150)
def test_two_studies_in_one_run_dir_never_share_checkpoints(tmp_path):
    """The second study's trials train from step 0 (before: lineages 0 and 1 of study b loaded study a's
    finished checkpoints and completed with a's values without training)."""
    a = StudySpec.from_dict(spec_dict(tmp_path, study="a", n_trials=2, max_retries=0))
    run_study(a)
    b = StudySpec.from_dict(spec_dict(tmp_path, study="b", n_trials=2, max_retries=0,
                                      sampler={"name": "random", "seed": 11}))
    assert a.run_dir == b.run_dir and a.storage == b.storage
    res = run_study(b)
    assert res.complete == 2 and not res.failures
    for t in trials_of(b):
        assert sorted(t.intermediate_values) == [10, 20, 30]  # trained from scratch, not from a's checkpoint
    dirs = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert len(dirs) == 2 and dirs[0].startswith("a-") and dirs[1].startswith("b-")


def test_a_checkpoint_of_another_trial_is_refused_loudly(tmp_path):
    meta = {"study_uid": "u1", "lineage": 0, "params": {"lr": 0.1, "width": 8}}
    path = tmp_path / "lineage-0.pt"
    checkpoint.save(path, {"step": 30, "value": 0.9}, meta)
    assert checkpoint.load(path, meta) == {"step": 30, "value": 0.9}
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"params\.width \(8 in the file, 4 in the trial\)"):
        checkpoint.load(path, {**meta, "params": {"lr": 0.1, "width": 4}})
    with pytest.raises(checkpoint.CheckpointMismatch, match="study_uid"):
        checkpoint.load(path, {**meta, "study_uid": "u2"})
    torch.save({"step": 30, "value": 0.9}, tmp_path / "old.pt")  # the layout before owner records
    with pytest.raises(checkpoint.CheckpointMismatch, match="no owner record"):
        checkpoint.load(tmp_path / "old.pt", meta)


def test_checkpoint_save_syncs_and_removes_stale_temporaries(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()      # a pid that has exited
    stale = tmp_path / f"lineage-3.tmp{dead}"
    stale.write_bytes(b"half a checkpoint (kill -9 mid-write)")
    other = tmp_path / "lineage-4.tmp1"                               # another lineage's: not ours to remove
    other.write_bytes(b"x")
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    meta = {"study_uid": "u", "lineage": 3, "params": {}}
    checkpoint.save(tmp_path / "lineage-3.pt", {"step": 1}, meta)
    assert len(synced) >= 1 and not stale.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lineage-3.pt", "lineage-4.tmp1"]
    assert checkpoint.load(tmp_path / "lineage-3.pt", meta) == {"step": 1}


@pytest.mark.timeout(150)
def test_a_copied_checkpoint_fails_its_trial_without_retry(tmp_path):
    """A file on a trial's checkpoint path that belongs to another configuration fails that trial for good
    (``checkpoint``), it never continues from it."""
    d = spec_dict(tmp_path, n_trials=1, max_retries=2, pool={"fake": 1, "memory_gb": 2})
    drv = Driver(StudySpec.from_dict(d))
    try:
        checkpoint.save(drv.checkpoint_dir / "lineage-0.pt", {"step": 30, "value": 0.99},
                        {"study_uid": "someone-else", "lineage": 0, "params": {}})
        res = drv.run()
    finally:
        drv.shutdown()
    assert res.complete == 0 and res.failures == {"checkpoint": 1}
    (t,) = drv.study.get_trials()
    assert t.state.name == "FAIL" and "belongs to another trial" in t.user_attrs["hpdl_failure"]


@pytest.mark.timeout(200)
def test_second_driver_refused_then_sigint_stops_busy_workers_fast_and_resume_completes(tmp_path):
    d = spec_dict(tmp_path, workload="hpo_fixture_workloads:SlowCNN", n_trials=4, max_retries=0,
                  pool={"fake": 4, "memory_gb": 2}, fixed={**FIXED, "steps": 200, "sleep_s": 0.05})
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(d))
    spec = StudySpec.from_dict(d)
    log = open(tmp_path / "driver.log", "w")
    proc = start_cli("hpo", "run", str(path), "--no-progress", out=log)
    try:
        deadline, busy = time.monotonic() + 150, []
        while time.monotonic() < deadline and len(busy) < 4:
            time.sleep(0.3)
            try:
                busy = [t for t in trials_of(spec) if t.state.name == "RUNNING" and (t.last_step or 0) >= 20]
            except Exception:  # noqa: BLE001 - the study may not exist yet
                continue
        assert len(busy) == 4, f"4 busy trials expected within 150 s, saw {len(busy)}"
        # a second driver (resume) on the live study: refused, naming the live one; nothing of it changed
        with pytest.raises(HpoError, match=f"live driver: pid {proc.pid} "):
            Driver(spec, resume=True)
        assert proc.poll() is None and not [t for t in trials_of(spec) if t.state.name == "FAIL"]
        n = sum(t.state.name == "RUNNING" for t in trials_of(spec))  # a trial may have finished meanwhile
        assert n >= 3
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(20)  # the driver's exit, as a shell sees it
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    err = (tmp_path / "driver.log").read_text()
    assert proc.returncode == 130 and took < 5.0, (proc.returncode, took, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "interrupted by SIGINT" in lines[0] and f"stopped {n} running trials" in lines[0], err
    # the command named resumes *this* study (a bare `hpdl hpo resume` resumed the shipped example instead)
    assert lines[0].endswith(f"`hpdl hpo resume {path}` continues"), err
    trials = trials_of(spec)
    assert not [t for t in trials if t.state.name in ("RUNNING", "FAIL")]  # an interrupt is no failure
    waiting = [t for t in trials if t.state.name == "WAITING"]
    assert len(waiting) == n and all(t.user_attrs.get("hpdl_attempt", 0) == 0 for t in waiting)
    assert all(t.user_attrs["hpdl_requeued"][-1].startswith("interrupted") for t in waiting)
    res = run_study(spec, resume=True)
    assert res.complete == 4 and not res.failures
    trials = trials_of(spec)
    assert len(trials) == 4 and {t.state.name for t in trials} == {"COMPLETE"}  # one trial per configuration
    for t in trials:
        if t.number in {w.number for w in waiting}:  # re-queued: the same trial, continued from its checkpoint
            assert min(t.intermediate_values) <= 20 < max(t.intermediate_values)


def test_unwritable_run_dir_and_checkpoint_folder_are_named_before_anything_runs(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(HpoError, match=r"run_dir '.*file/run' is not writable"):
        Driver(StudySpec.from_dict(spec_dict(tmp_path, run_dir=str(tmp_path / "file" / "run"))))
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("")  # where the folder should be (chmod does not stop root)
    with pytest.raises(HpoError, match=r"checkpoint folder '.*run/checkpoints' is not writable"):
        Driver(StudySpec.from_dict(spec_dict(tmp_path)))
    assert not (run / "study.db").exists()  # refused before a store was created


def test_resume_of_a_missing_study_creates_no_store(tmp_path):
    with pytest.raises(HpoError, match="not found: no study store"):
        Driver(StudySpec.from_dict(spec_dict(tmp_path)), resume=True)
    assert not (tmp_path / "run" / "study.db").exists()


@pytest.mark.timeout(120)
def test_a_study_in_which_every_configuration_failed_exits_non_zero(tmp_path, capsys):
    d = spec_dict(tmp_path, workload="hpo_fixture_workloads:AlwaysRaiseCNN", n_trials=1, max_retries=0,
                  pool={"fake": 1, "memory_gb": 2})
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(d))
    parser = argparse.ArgumentParser()
    HpoCommand.add_arguments(parser)
    assert HpoCommand().run(parser.parse_args(["run", str(path), "--no-progress"])) == 1
    out, err = capsys.readouterr()
    assert "0 complete" in out and "no completed configuration" in err


@pytest.mark.timeout(150)
def test_a_checkpoint_folder_that_becomes_unwritable_stops_the_study_and_loses_no_configuration(tmp_path):
    """Before: every trial failed ``error`` at its next checkpoint write, each configuration spent its
    attempts, the budget ended "0 complete" and `resume` reported the study done. Now the first failed write
    stops the study naming the path, its trials are re-queued as they were, and a resume completes them."""
    d = spec_dict(tmp_path, n_trials=2, max_retries=0)
    spec = StudySpec.from_dict(d)
    drv = Driver(spec)
    ckpt = drv.checkpoint_dir
    ckpt.rmdir()
    ckpt.write_text("")  # the folder is gone and cannot be created (chmod does not stop root)
    with pytest.raises(HpoError, match=r"cannot write checkpoint '.*lineage-\d\.pt'.*checkpoint folder"):
        drv.run()
    trials = trials_of(spec)
    assert not [t for t in trials if t.state.name in ("RUNNING", "FAIL") or t.user_attrs.get("hpdl_gave_up")]
    assert all(t.user_attrs["hpdl_requeued"][-1].startswith(("checkpoint_write", "interrupted", "not_started"))
               for t in trials if t.state.name == "WAITING")
    assert {t.user_attrs.get("hpdl_attempt", 0) for t in trials} == {0}
    ckpt.unlink()
    res = run_study(spec, resume=True)
    assert res.complete == 2 and not res.failures


def test_drivers_of_one_sqlite_store_in_two_run_dirs_exclude_each_other_by_lock(tmp_path):
    """Two driver processes on this host that share a store from two run folders and start at the same
    moment: before, each took its own run folder's lock and both passed the heartbeat check when neither had
    beaten yet. (Drivers in one process share the store's lock, as tests that stand in for nodes do.)"""
    import subprocess
    import sys

    from hpdl.hpo.lock import StudyLock

    storage = f"sqlite:///{tmp_path / 'store' / 'study.db'}"
    other = ("import sys; from hpdl.hpo.lock import StudyLock\n"
             "try:\n    StudyLock(sys.argv[1], sys.argv[2], sys.argv[3]).acquire(); print('acquired')\n"
             "except Exception as e:\n    print(e)\n")

    def second(run_dir, study):
        return subprocess.run([sys.executable, "-c", other, str(run_dir), study, storage], capture_output=True,
                              text=True, timeout=60).stdout

    a = StudyLock(tmp_path / "r1", "s", storage)
    a.acquire()
    try:
        out = second(tmp_path / "r2", "s")
        assert "live driver: pid" in out and "r1" in out, out
        assert second(tmp_path / "r2", "s_other").strip() == "acquired"  # another study of the store: free
        b = StudyLock(tmp_path / "r3", "s/x", storage)
        b.acquire()
        try:  # "s/x" and "s_x" share a file-name stem, not a lock
            assert second(tmp_path / "r4", "s_x").strip() == "acquired"
        finally:
            b.release()
    finally:
        a.release()
    assert second(tmp_path / "r2", "s").strip() == "acquired"  # released with its holder


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_start_up_stops_at_once_with_one_line(tmp_path, sig):
    # before the driver's loop installs its handlers: SIGINT inherited ignored (a script's background job)
    # was dropped and the study ran to its end; SIGTERM killed the process with no message
    script = f"""
import os, signal, sys, time
import hpdl.hpo.driver as driver
def slow_start(spec, **kw):   # stands in for the store, study and pool start-up
    os.kill(os.getpid(), {int(sig)})
    time.sleep(30)
    raise SystemExit(7)
driver.run_study = slow_start
from hpdl.cli import main
sys.exit(main(["hpo", "run", "--run-dir", {str(tmp_path / "run")!r}, "--no-progress"]))
"""
    env = {**os.environ, "HPDL_HPO_START_METHOD": "spawn"}
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert time.monotonic() - t < 25, "the signal did not stop the start-up"
    assert p.returncode == 128 + sig, (p.returncode, p.stderr[-2000:])
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "during start-up" in lines[0] and signal.Signals(sig).name in lines[0], p.stderr


@pytest.mark.timeout(150)
def test_run_on_a_finished_study_names_overwrite_which_starts_afresh(tmp_path, capsys):
    """Issue 37: `hpo run` on a finished study said only "use resume" (which has nothing left to do)."""
    d = spec_dict(tmp_path, n_trials=1, max_retries=0, fixed={**FIXED, "steps": 10, "eval_every": 5})
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(d))
    spec = StudySpec.from_dict(d)
    first = run_study(spec)
    assert first.complete == 1
    old_ckpts = list((tmp_path / "run" / "checkpoints").iterdir())
    assert len(old_ckpts) == 1
    with pytest.raises(HpoError, match=r"already exists .*\(1/1 configurations finished\); `hpdl hpo resume` "
                                       r"continues it, `hpdl hpo run --overwrite` deletes it and starts afresh"):
        run_study(spec)
    with pytest.raises(HpoError, match="exclude each other"):
        run_study(spec, resume=True, overwrite=True)
    parser = argparse.ArgumentParser()
    HpoCommand.add_arguments(parser)
    args = parser.parse_args(["run", str(path), "--no-progress", "--overwrite", "--format", "json"])
    assert HpoCommand().run(args) == 0
    capsys.readouterr()
    trials = trials_of(spec)
    assert [t.state.name for t in trials] == ["COMPLETE"] and trials[0].number == 0  # a new study, not appended
    assert not old_ckpts[0].exists()  # the deleted study's checkpoints went with it


def test_a_signal_that_lands_where_python_ignores_exceptions_still_stops_the_start_up(tmp_path):
    """Issue 37's sweep: SIGINT landed in a weakref callback, whose exception Python prints as "Exception
    ignored" and drops; the start-up went on and the study ran to its end with exit 0."""
    script = f"""
import os, signal, sys, time, weakref
import hpdl.hpo.driver as driver
class X: pass
def slow_start(spec, **kw):   # stands in for the start-up; a weakref callback runs in the middle of it
    x = X()
    def callback(_ref):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10000): pass   # the handler runs here, inside the callback
    ref = weakref.ref(x, callback)
    del x
    for _ in range(300): time.sleep(0.01)
    raise SystemExit(7)
driver.run_study = slow_start
from hpdl.cli import main
sys.exit(main(["hpo", "run", "--run-dir", {str(tmp_path / "run")!r}, "--no-progress"]))
"""
    env = {**os.environ, "HPDL_HPO_START_METHOD": "spawn"}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 130, (p.returncode, p.stderr[-2000:])
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpdl hpo: interrupted by SIGINT: ") and "start-up" in lines[0], \
        p.stderr
