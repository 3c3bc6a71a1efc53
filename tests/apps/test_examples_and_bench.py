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
            # issue 37 item 6: --comm nccl on CPU runs over gloo and must say so, not print `nccl`
            assert "comm=gloo (asked: nccl" in proc.stdout and "comm=nccl" not in proc.stdout
        else:
            assert len(result["losses"]) == 2 and result["world_size"] == 1
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "cg.py"), "--comm", "gloo"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "invalid choice: 'gloo'" in bad.stderr


def _script_main(name):
    from hpdl.apps import cli

    return {"train_gpt": cli.main_train, "cg": cli.main_cg, "fft3d": cli.main_fft}[name]


def _documented_comms():
    """(script, --comm value) for every `examples/X.py --comm A` in README.md and docs/apps.md, including the
    alternatives a comment lists after it (`# or nccl / hpdl-ddp`)."""
    import re

    found = set()
    for doc in ("README.md", "docs/apps.md"):
        for line in open(os.path.join(ROOT, doc)):
            m = re.search(r"examples/(\w+)\.py\b.*?--comm ([\w-]+)(.*)", line)
            if not m:
                continue
            found.add((m.group(1), m.group(2)))
            comment = m.group(3).partition("#")[2].strip()
            if comment.startswith("or ") or comment.startswith("--comm"):   # alternatives to the value shown
                alts = comment.split("(")[0].removeprefix("or ").removeprefix("--comm")
                found |= {(m.group(1), w) for w in re.findall(r"[\w-]+", alts)}
    return sorted(found)


def test_docs_and_scripts_agree_on_comm(capsys):
    """Issue 37 item 6: the README listed `train_gpt.py --comm ... mpi`, which the script rejects."""
    pairs = _documented_comms()
    assert ("train_gpt", "hpdl-ddp") in pairs and ("cg", "mpi") in pairs, pairs
    for script, comm in pairs:
        with pytest.raises(SystemExit) as exc:   # --help after --comm: exit 0 only if the value parsed
            _script_main(script)(["--comm", comm, "--help"])
        assert exc.value.code == 0, (script, comm, capsys.readouterr().err)
    with pytest.raises(SystemExit) as exc:
        _script_main("train_gpt")(["--comm", "mpi"])
    assert exc.value.code == 2 and "cg.py and fft3d.py take --comm mpi" in " ".join(_help("train_gpt", capsys).split())


def _help(script, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit):
        _script_main(script)(["--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("script", ["train_gpt", "cg", "fft3d"])
def test_example_help_describes_every_option(script, capsys):
    """Issue 37 item 6: `--help` of the example scripts listed bare option names, no description or default."""
    import re

    text = _help(script, capsys)
    options = text.split("options:")[1]
    entries = re.split(r"\n  (?=-)", options)[1:]
    assert len(entries) > 5
    for entry in entries:
        flat = " ".join(entry.split())
        name = flat.split()[0]
        assert len(flat) > len(name) + 12, f"{script} {name} has no description: {flat!r}"
        if name not in ("-h,", "--json"):
            assert "(default:" in flat, f"{script} {name} shows no default: {flat!r}"


@pytest.mark.parametrize("argv,flag", [(["--shape", "8,8"], "--shape"), (["--shape", "a,b,c"], "--shape"),
                                       (["--shape", "0,8,8"], "--shape"), (["--grid", "x"], "--grid"),
                                       (["--grid", "1,0"], "--grid"), (["--grid", "1,1,1"], "--grid")])
def test_fft3d_shape_and_grid_are_usage_errors_naming_the_flag(argv, flag, capsys):
    # "8,8" and "a,b,c" ended in a rank traceback / a ValueError traceback instead of a usage error
    from hpdl.apps import cli

    with pytest.raises(SystemExit) as exc:
        cli.main_fft(argv)
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
