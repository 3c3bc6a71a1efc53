"""Workloads train for real, estimate their cost, and resume exactly from a checkpoint (CPU)."""

import contextlib
import json
import math
import time
from pathlib import Path

import pytest
import torch

from hpdl.hpo.errors import HpoConfigError
from hpdl.hpo.profiler import ProfileCache, StepProfiler, static_profile
from hpdl.hpo.trial import LocalTrial
from hpdl.hpo.workloads import get_workload


class Ctx(LocalTrial):
    """hpdl.hpo.LocalTrial with a checkpoint every evaluation that optionally stops (dies) at a step."""

    def __init__(self, params, stop_at=None, store=None):
        super().__init__(params, checkpoint_every=1, store=store)
        self.stop_at = stop_at

    @contextlib.contextmanager
    def step(self, s):
        if s == self.stop_at:
            raise KeyboardInterrupt  # simulate the process dying here
        yield


CNN = {"width": 8, "depth": 1, "batch_size": 32, "image_size": 16, "steps": 40, "eval_every": 10, "lr": 0.1}
GPT = {"n_embd": 32, "n_layer": 1, "n_head": 2, "block_size": 16, "batch_size": 8, "steps": 40, "eval_every": 10}


@pytest.mark.parametrize("name,params", [("cnn", CNN), ("gpt", GPT)])
def test_resume_from_checkpoint_matches_uninterrupted(name, params):
    torch.set_num_threads(1)
    w = get_workload(name)
    full = w.train(Ctx(params))
    store = {}
    with pytest.raises(KeyboardInterrupt):
        w.train(Ctx(params, stop_at=25, store=store))
    assert store["ckpt"]["step"] == 20
    resumed = Ctx(params, store=store)
    assert w.train(resumed) == pytest.approx(full, rel=1e-5, abs=1e-6)
    assert [s for s, _ in resumed.reports] == [30, 40]


def test_training_learns():
    torch.set_num_threads(1)
    acc = get_workload("cnn").train(Ctx({**CNN, "steps": 60, "width": 16}))
    assert acc > 0.3  # chance is 0.1
    ctx = Ctx({**GPT, "steps": 60, "lr": 1e-2})
    get_workload("gpt").train(ctx)
    assert ctx.reports[-1][1] < ctx.reports[0][1] < math.log(256) + 0.5


def test_estimate_and_static_profile_scale_with_size():
    w = get_workload("cnn")
    small, big = w.estimate({**CNN}), w.estimate({**CNN, "batch_size": 64, "width": 16})
    assert big["activation_bytes"] > 3 * small["activation_bytes"] and big["flops"] > 3 * small["flops"]
    # one conv output of (B, width, S, S) fp32 is among the module outputs
    assert small["activation_bytes"] >= 32 * 8 * 16 * 16 * 4
    p = static_profile(w, CNN, "cpu", context_bytes=0)
    assert p.memory_bytes > 2 * small["activation_bytes"] and not p.measured


def test_step_profiler_on_cpu_and_cache(tmp_path: Path):
    w = get_workload("cnn")
    st = static_profile(w, CNN, "cpu", context_bytes=0)
    prof = StepProfiler(torch.device("cpu"), "cpu", st, warmup=1, window=3, peak_flops=1e9)
    prof.interrupt()
    parts = w.build(w.resolve(CNN), torch.device("cpu"))
    for s in range(5, 10):
        prof.before(s)
        x, y = parts.batch(s)
        parts.loss(parts.model(x), y).backward()
        prof.after(s)
    r = prof.result
    assert r is not None and r.source == "cpu" and r.step_time_s > 0 and 0 < r.compute <= 1
    cache = ProfileCache(tmp_path / "p.json")
    cache.put("k", r)
    cache.put("k", st.__class__(**{**st.__dict__, "kind": "cpu"}))  # static never replaces measured
    assert ProfileCache(tmp_path / "p.json").get("k", "cpu").source == "cpu"
    cache.put("k2", st)  # static: step time and compute unmeasured (NaN in memory)
    doc = json.loads((tmp_path / "p.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert doc["cpu|k2"]["compute"] is None and doc["cpu|k2"]["step_time_s"] is None
    again = ProfileCache(tmp_path / "p.json").get("k2", "cpu")
    assert math.isnan(again.compute) and math.isnan(again.step_time_s) and again.memory_bytes == st.memory_bytes


def test_bad_workload_names():
    with pytest.raises(HpoConfigError, match="expected one of"):
        get_workload("resnet")
    with pytest.raises(HpoConfigError, match="cannot be imported.*PYTHONPATH=. hpdl hpo run"):
        get_workload("no_such_module:X")   # a module beside the study file: the `hpdl` script does not see it
    with pytest.raises(HpoConfigError, match="cannot be imported") as info:
        get_workload("hpdl.hpo.workloads:NoSuchClass")
    assert "PYTHONPATH" not in str(info.value)   # the module was found: no path hint
    with pytest.raises(HpoConfigError, match="unknown parameters"):
        get_workload("cnn").resolve({"widht": 3})


def test_step_profiler_excludes_evaluations_between_steps_and_finishes_in_window_steps():
    """Short trials evaluate often: an evaluation between timed steps must neither restart the window
    (the profile would never finish) nor count as step time."""
    st = static_profile(get_workload("cnn"), CNN, "cpu", context_bytes=0)
    prof = StepProfiler(torch.device("cpu"), "cpu", st, warmup=1, window=3, peak_flops=1e9)
    for s in range(4):  # 1 warm-up step, then 3 timed steps of ~10 ms with a 0.3 s "evaluation" between
        prof.before(s)
        time.sleep(0.01)
        prof.after(s)
        if s < 3:
            assert not prof.done
            time.sleep(0.3)
            prof.interrupt()
    assert prof.done and prof.result.source == "cpu"
    assert 0.009 < prof.result.step_time_s < 0.1  # the median step, not the evaluation gaps


def test_warm_worker_has_paid_the_first_optimizer_import(tmp_path):
    """The first optimizer a process builds imports torch._dynamo (2-3 s): a worker's environment (what a
    warm worker builds before it says ready) pays it, not the first trial. Checked in a fresh interpreter
    (this one may have imported it already)."""
    import subprocess
    import sys

    run = str(tmp_path / "run")
    (tmp_path / "run").mkdir()
    code = ("import sys, optuna\n"
            "from hpdl.hpo.spec import StudySpec\n"
            "spec = StudySpec.from_dict({'study': 'w', 'workload': 'cnn', 'n_trials': 1, 'run_dir': %r,\n"
            "    'space': {'lr': {'type': 'float', 'low': 0.01, 'high': 0.1}}, 'pool': {'fake': 1}})\n"
            "optuna.create_study(study_name='w', storage=spec.storage)\n"
            "before = 'torch._dynamo' in sys.modules\n"
            "from hpdl.hpo.worker import _Env\n"
            "_Env({'kind': 'cpu', 'torch_device': 'cpu'}, {**spec.to_dict(), 'storage': spec.storage,\n"
            "     'run_dir': %r}, 'cpu')\n"
            "print(before, 'torch._dynamo' in sys.modules)\n") % (run, run)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = out.stdout.split()[-2:]
    if before == "True":
        pytest.skip("this torch imports torch._dynamo eagerly: nothing to warm")
    assert after == "True"
