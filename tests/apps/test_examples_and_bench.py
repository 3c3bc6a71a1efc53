"""The example scripts run as one process, and the benchmark's job, summary, table and plot work end to end."""

import json
import os
import subprocess
import sys
import sysconfig

import pytest

from hpdl.apps import bench
from hpdl.testing import get_pool

import _apps_cases as C

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.timeout(300)
def test_benchmark_job_checks_and_reports(tmp_path):
    plan = bench.Plan(cg_sizes=[8], cg_iters=5, cg_variants=["nccl", "hpdl:auto"], fft_shapes=[[8, 6, 4]],
                      fft_iters=1, fft_variants=["nccl", "hpdl:pairwise"], gpt_steps=2,
                      gpt_variants=["nccl", "hpdl"], gpt={"n_layer": 1, "n_head": 1, "n_embd": 16,
                                                         "block_size": 16, "batch_size": 1}, rounds=2)
    rows = get_pool(2).run(C.bench_job, plan)[0]
    assert len(rows) == 2 * (2 + 2 + 2)
    summary = bench.summarize(rows)
    by = {(s["app"], s["variant"]): s for s in summary}
    assert by[("fft3d", "hpdl:pairwise")]["wrong"] == 0 and by[("cg", "nccl")]["vs_native"] == 1.0
    assert by[("cg", "hpdl:auto")]["max_rel_diff"] == 0.0 and by[("gpt", "hpdl")]["max_rel_diff"] == 0.0
    assert "allreduce_s" in by[("cg", "hpdl:auto")] and "alltoall_s" in by[("fft3d", "nccl")]
    table = bench.format_table(summary)
    assert "us/iter" in table and "#wrong 0" in table
    bench.plot(summary, rows, str(tmp_path / "apps.png"), "test")
    assert (tmp_path / "apps.png").stat().st_size > 10_000


@pytest.mark.timeout(300)
def test_examples_run_as_one_process(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), OMP_NUM_THREADS="1")
    data = sysconfig.get_paths()["stdlib"] + "/typing.py"
    runs = {"cg": ["--size", "8", "--iters", "5", "--warmup", "1"],
            "fft3d": ["--shape", "8,6,4", "--iters", "1", "--warmup", "0", "--comm", "nccl"],
            "train_gpt": ["--steps", "2", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
                          "--batch-size", "2", "--data", data]}
    for name, args in runs.items():
        out = tmp_path / f"{name}.json"
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", f"{name}.py"), *args, "--json", str(out)],
                              capture_output=True, text=True, timeout=240, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(out.read_text())
        assert name.split("_")[0] in proc.stdout
        if name == "cg":
            assert len(result["residuals"]) == 7 and result["time_s"] > 0
        elif name == "fft3d":
            assert result["meta"]["grid"] == [1, 1]
        else:
            assert len(result["losses"]) == 2 and result["world_size"] == 1
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "cg.py"), "--comm", "gloo"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "invalid choice: 'gloo'" in bad.stderr
