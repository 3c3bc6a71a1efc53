"""Local worker processes: start method (forkserver with preloaded imports, or spawn) and environment."""

import multiprocessing as mp

import pytest

from hpdl.hpo.driver import run_study
from hpdl.hpo.errors import HpoError
from hpdl.hpo.launch import START_METHOD_ENV, worker_context
from hpdl.hpo.spec import StudySpec

FIXED = {"depth": 1, "batch_size": 16, "image_size": 8, "steps": 10, "eval_every": 10, "width": 4}


def test_worker_context_defaults_to_a_preloading_forkserver(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    expected = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    assert worker_context().get_start_method() == expected
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert worker_context().get_start_method() == "spawn"
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(HpoError, match="HPDL_HPO_START_METHOD='fork', expected 'forkserver' or 'spawn'"):
        worker_context()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_see_the_drivers_environment_at_their_own_start(tmp_path, monkeypatch, method):
    """A forkserver keeps the environment it started with; workers must still see the driver's current
    one (a second study after the variable changed), as spawned workers do. Warm pool of one worker."""
    monkeypatch.setenv(START_METHOD_ENV, method)
    for mark in ("first", "second"):
        monkeypatch.setenv("HPDL_TEST_MARK", mark)
        out = tmp_path / mark
        out.mkdir()
        spec = StudySpec.from_dict({
            "study": mark, "workload": "hpo_fixture_workloads:EnvRecordingCNN", "n_trials": 1,
            "run_dir": str(tmp_path / f"run-{mark}"), "warm_workers": 1,
            "space": {"lr": {"type": "float", "low": 0.02, "high": 0.2}},
            "fixed": {**FIXED, "crash_dir": str(out), "env_var": "HPDL_TEST_MARK"},
            "pool": {"fake": 1, "memory_gb": 2}, "policy": {"name": "one_per_gpu"}})
        res = run_study(spec)
        assert res.complete == 1 and not res.failures
        assert (out / "env-0").read_text() == mark
