"""The run summary's two clocks (issue 39): ready (the driver's, from a ready warm pool) and counted in (from
the `hpdl` process's start to the end of the teardown), printed and written to ``--out``."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpdl.hpo.cli import _clocks_line
from hpdl.hpo.driver import StudyResult

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_clocks_line_names_both_clocks_and_what_lies_between():
    res = StudyResult("s", "pack", 2, {}, 10.25, 2, 0, {}, 0.5, {}, [], warmup_s=2.0, teardown_s=0.5,
                      counted_s=14.0, setup_s=3.5, counted_from=1.0,
                      setup_phases={"before_driver": 1.0, "driver": 0.5, "pool": 2.0})
    line = _clocks_line(res)
    assert line == ("clocks: ready 10.2 s, counted in 14.0 s (before ready 3.5 s: start-up and imports 1.0, "
                    "study set-up 0.5, warm pool 2.0; teardown 0.5 s)")


@pytest.mark.timeout(240)
def test_hpdl_hpo_run_reports_ready_and_counted_in_clocks(tmp_path):
    """`hpdl hpo run` as a program: the summary prints both clocks and ``--out`` holds them; counted in starts
    at the process's start (before the driver: the interpreter and the imports), so it holds the ready clock,
    the set-up before it and the teardown. Checks relations between the clocks, never a duration."""
    study = {"study": "clocks", "workload": "cnn", "n_trials": 2, "run_dir": str(tmp_path / "run"),
             "sampler": {"name": "random", "seed": 0},
             "space": {"lr": {"type": "float", "low": 0.02, "high": 0.2, "log": True}},
             "fixed": {"width": 4, "depth": 1, "batch_size": 8, "image_size": 8, "steps": 4, "eval_every": 2,
                       "val_size": 16},
             "pool": {"fake": 1, "memory_gb": 2}, "policy": {"name": "one_per_gpu"}, "warm_workers": 1,
             "mps": False}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "hpdl.cli", "hpo", "run", str(path), "--no-progress", "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["complete"] == 2
    ph = r["setup_phases"]
    assert set(ph) == {"before_driver", "driver", "pool"}
    assert ph["before_driver"] > 0 and ph["driver"] > 0 and ph["pool"] == pytest.approx(r["warmup_s"], abs=1e-3)
    # counted in = set-up before ready + ready clock + teardown (up to bookkeeping between them: mixed clocks)
    assert r["counted_s"] >= r["wall_s"] > 0
    assert r["setup_s"] >= ph["before_driver"] + ph["driver"] + ph["pool"] - 0.01
    assert r["counted_s"] >= r["setup_s"] + r["wall_s"] + r["teardown_s"] - 0.01
    assert r["counted_from"] <= r["started_at"] - r["setup_s"] + 0.01  # the origin lies before the ready clock
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("clocks:"))
    assert f"ready {r['wall_s']:.1f} s" in line and f"counted in {r['counted_s']:.1f} s" in line


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy, traces", [("one_per_gpu", False), ("pack", True)])
def test_only_a_policy_that_places_by_estimates_traces_one(tmp_path, policy, traces):
    """The first meta-device trace costs the driver seconds before its pool is ready (it imports
    ``torch._dynamo`` through the workload's optimizer); the baselines never use an estimate
    (placement: they place blind), so they must not pay it. Before 2026-12-04 every policy traced one."""
    import hpo_fixture_workloads as fx

    from hpdl.hpo.driver import run_study
    from hpdl.hpo.spec import StudySpec

    fx.ESTIMATES.clear()
    res = run_study(StudySpec.from_dict({
        "study": "est", "workload": "hpo_fixture_workloads:EstimateRecordingCNN", "n_trials": 2,
        "run_dir": str(tmp_path / "run"), "sampler": {"name": "random", "seed": 0},
        "space": {"lr": {"type": "float", "low": 0.02, "high": 0.2, "log": True}},
        "fixed": {"width": 4, "depth": 1, "batch_size": 8, "image_size": 8, "steps": 4, "eval_every": 2,
                  "val_size": 16},
        "pool": {"fake": 1, "memory_gb": 2}, "policy": {"name": policy}, "warm_workers": 1, "mps": False}))
    assert res.complete == 2
    assert bool(fx.ESTIMATES) is traces, fx.ESTIMATES


def test_hpdl_hpo_run_starts_the_forkserver_before_anything_imports_torch(tmp_path):
    """The workers' server imports torch and ``torch._dynamo`` (about 9 s on the H200 host, the longest path
    before ready): it must start before the `hpdl hpo run` process imports torch itself, so that the two
    import side by side (hpdl.runtime itself is torch-free: its launch module is the one that imports torch).
    The command is stopped where it would start the server."""
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({"study": "s", "workload": "cnn", "n_trials": 1, "run_dir": str(tmp_path / "r"),
                                    "space": {"lr": {"type": "float", "low": 0.01, "high": 0.1}},
                                    "pool": {"fake": 1}}))
    code = ("import sys\n"
            "import hpdl.hpo._prestart as prestart\n"
            "class Stop(BaseException):\n"
            "    pass\n"
            "def start():\n"
            "    print(sorted(m for m in ('torch', 'optuna', 'hpdl.hpo.driver', 'hpdl.runtime.launch') if m in sys.modules))\n"
            "    raise Stop\n"
            "prestart.start_forkserver = start\n"
            "from hpdl.cli import main\n"
            "try:\n"
            "    main(['hpo', 'run', %r, '--no-progress'])\n"
            "except Stop:\n"
            "    print('stopped')\n") % str(path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[]", "stopped"], proc.stdout
