"""`hpdl bench` as a user meets it: labels of auto rows, output off a terminal, noise, torchrun, help, --graph."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpdl.bench.harness import NOISE, BenchConfig, Row, _progress, algo_label, graph_calls, resolve_auto, speedup_text
from hpdl.bench.report import format_table
from hpdl.cli import build_parser, main
from hpdl.comm.algorithms.base import algorithms_for, phase_algorithms

ROOT = Path(__file__).resolve().parents[2]
COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather", "alltoall")


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _bench(*argv, timeout=400):
    """``hpdl bench ...`` with stdout and stderr redirected to pipes (not a terminal), as in a batch job."""
    return subprocess.run([sys.executable, "-m", "hpdl.cli", "bench", *argv], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=ROOT)


def _subparser(collective):
    bench = build_parser("bench")._subparsers._group_actions[0].choices["bench"]
    return bench._subparsers._group_actions[0].choices[collective]


def _help(collective) -> str:
    return " ".join(_subparser(collective).format_help().split())


def _row(algo, us, lo=None, hi=None, resolved=None, speedup=None, s_lo=None, s_hi=None):
    return Row(64, 16, "float32", "sum", algo, resolved or algo, None, us, us, us, 1.0, 1.0, 0, 9, speedup,
               lo if lo is not None else us, hi if hi is not None else us, s_lo, s_hi)


# ------------------------------------------------------------------ 1. reduce_scatter's auto label
@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_auto_of_the_phase_collectives_names_an_algorithm_they_have(collective, world):
    """auto on reduce_scatter/all_gather resolves through the all-reduce table; whatever it picks there
    (recursive_doubling at small sizes on CPU) must be mapped to a schedule with the two phases."""
    picks = {resolve_auto(collective, 8 << k, world, "cpu")[0] for k in range(28)}
    assert picks <= set(phase_algorithms()), picks
    assert "recursive_doubling" not in picks


def test_auto_of_alltoall_names_an_alltoall_algorithm():
    assert {resolve_auto("alltoall", 8 << k, 4, "cpu")[0] for k in range(28)} <= set(algorithms_for("all_to_all"))


def test_algorithm_names_are_never_cut():
    rows = [_row("native", 10.0, speedup=1.0), _row("auto", 5.0, resolved="recursive_doubling", speedup=2.0,
                                                   s_lo=1.9, s_hi=2.1)]
    text = format_table(rows)
    assert "auto->recursive_doubling" in text
    lines = [l for l in text.splitlines() if l and not l.startswith("# ")]
    assert len({len(l) for l in lines}) == 1, lines  # header and rows aligned


@pytest.fixture(scope="module")
def rs_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("rs") / "rs.json"
    r = _bench("reduce_scatter", "--np", "2", "-b", "8", "-e", "64", "-f", "8", "--algorithms", "native,auto",
               "--iters", "3", "--warmup", "0", "--time-per-point", "0.001", "--json", str(path))
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(path.read_text())


def test_reduce_scatter_run_labels_auto_with_what_it_runs(rs_run):
    r, data = rs_run
    autos = [row for row in data["rows"] if row["algorithm"] == "auto"]
    assert autos and all(row["resolved"] in phase_algorithms() for row in autos)
    for row in autos:
        assert f"auto->{row['resolved']}" in r.stdout
    assert "recursive_dou" not in r.stdout


# ------------------------------------------------------------------ 2. off a terminal, noise
def test_redirected_run_prints_a_progress_line_per_size(rs_run):
    r, data = rs_run
    lines = [l for l in r.stderr.splitlines() if l.startswith("[")]
    sizes = sorted({row["size"] for row in data["rows"]})
    assert len(lines) == len(sizes) == 2, r.stderr
    assert lines[0].startswith("[1/2] reduce_scatter 8 B") and lines[1].startswith("[2/2] reduce_scatter 64 B")
    assert "native" in lines[0] and "auto->" in lines[0] and " us" in lines[0]


def test_progress_lines_are_flushed_one_per_size():
    class Stream(io.StringIO):
        flushes = 0

        def isatty(self):
            return False

        def flush(self):
            Stream.flushes += 1
            super().flush()

    stream = Stream()
    cfg = BenchConfig(sizes=[8, 16], algorithms=["native", "direct"])
    bar = _progress(True, cfg, stream)
    assert bar.mode == "lines"
    before = Stream.flushes
    bar.size_done(8, [_row("native", 10.0, speedup=1.0), _row("direct", 5.0, speedup=2.0, s_lo=1.9, s_hi=2.1)])
    assert Stream.flushes > before and stream.getvalue().splitlines()[-1].startswith("[1/2] allreduce 8 B")
    assert "direct 5.0 us 2.00x" in stream.getvalue()
    bar.size_done(16, [], skipped=True)
    assert "[2/2] allreduce 16 B" in stream.getvalue() and "skipped" in stream.getvalue()
    assert _progress(False, cfg, stream).mode == "off"  # ranks other than 0 print nothing


def test_speedup_shows_a_range_and_a_note_when_repeats_spread():
    native = _row("native", 10.0, lo=6.0, hi=18.0, speedup=1.0)
    same = _row("auto", 9.0, lo=8.0, hi=10.0, resolved="native", speedup=10 / 9, s_lo=6 / 10, s_hi=18 / 8)
    quiet = _row("direct", 5.0, lo=4.9, hi=5.1, speedup=2.0, s_lo=1.98, s_hi=2.02)
    assert same.noisy and not quiet.noisy and not native.noisy
    assert speedup_text(same) == "0.60-2.25x" and speedup_text(quiet) == "2.00x"
    text = format_table([native, same, quiet])
    assert "0.60-2.25x" in text and f"more than {NOISE:.0%}" in text
    assert "spread" not in format_table([_row("native", 10.0, speedup=1.0), quiet])


def test_run_reports_repeat_spread_per_row(rs_run):
    _, data = rs_run
    for row in data["rows"]:
        assert 0 < row["rep_min_us"] <= row["rep_max_us"]
        if row["algorithm"] != "native":
            assert row["speedup_lo"] <= row["speedup"] <= row["speedup_hi"]


# ------------------------------------------------------------------ 3. size options through torchrun
def _sample_value(action):
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(list(action.choices)[-1])]
    return {"min_size": ["1K"], "max_size": ["1M"]}.get(action.dest, ["3"])


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_every_bench_option_passes_through_torchrun_unchanged(collective):
    """torchrun's parser classifies every argument, even after the script: an option that is a prefix of two
    of its own (``--max`` of ``--max-restarts``/``--max_restarts``) aborts the launch. Every bench option but
    --np (spawning; torchrun sets the ranks) must reach hpdl untouched and parse there."""
    from torch.distributed.run import get_args_parser

    parser = _subparser(collective)
    ours = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "np"):
            continue
        for flag in action.option_strings:
            ours += [flag, *_sample_value(action)]
    argv = ["bench", collective, *ours]
    launched = get_args_parser().parse_args(["--nproc-per-node", "2", "-m", "hpdl.cli", *argv])
    assert launched.training_script == "hpdl.cli" and launched.training_script_args == argv
    args = build_parser("bench").parse_args(argv)
    assert args.min_size == 1024 and args.max_size == 1 << 20


def test_old_size_names_are_gone_from_help_but_short_nccl_tests_names_work():
    args = build_parser("bench").parse_args(["bench", "allreduce", "-b", "64", "-e", "4K", "-f", "4"])
    assert (args.min_size, args.max_size, args.factor) == (64, 4096, 4)
    text = _help("allreduce")
    assert "--min-bytes" in text and "--max-bytes" in text and "--max " not in text


# ------------------------------------------------------------------ 4. bench model without scipy
def test_model_without_scipy_says_what_to_install(tmp_path, monkeypatch, capsys):
    rows = [{"wrong": 0, "size": 1 << k, "resolved": algo, "avg_us": 10.0 * (k + 1)}
            for k in range(10, 16) for algo in ("direct", "ring")]
    path = tmp_path / "ar.json"
    path.write_text(json.dumps({"meta": {"world_size": 4, "ranks_per_node": 2, "collective": "allreduce"},
                                "rows": rows}))
    monkeypatch.setitem(sys.modules, "scipy", None)  # import scipy -> ModuleNotFoundError, as uninstalled
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    assert main(["bench", "model", "--calibrate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "scipy" in err and "pip install 'hpdl[comm]'" in err


def test_comm_extra_declares_scipy():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("scipy") for dep in extras["comm"])


# ------------------------------------------------------------------ 5. help texts
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_help_has_no_duplicate_or_empty_defaults(collective):
    text = _help(collective)
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "tuned) (default" not in text and "HPDL_TIMEOUT) (default" not in text


def test_alltoall_help_offers_only_what_alltoall_takes():
    text = _help("alltoall")
    assert "--op" not in text and "--tune" not in text
    for name in ("recursive_doubling", "one_shot", "two_shot", "two_level", "staged", "ring"):
        assert name not in text, name
    for name in algorithms_for("all_to_all"):
        assert name in text
    gather = _help("all_gather")
    assert "--op" not in gather and "--tune" not in gather and "recursive_doubling" not in gather


# ------------------------------------------------------------------ 6. --graph
def test_graph_on_cpu_is_a_clear_usage_error():
    r = _bench("allreduce", "--graph", "--np", "2", timeout=120)
    assert r.returncode == 2 and "--graph" in r.stderr and "--device cuda" in r.stderr
    assert "Traceback" not in r.stderr
    r = _bench("reduce_scatter", "--graph", timeout=120)  # not offered where it is not implemented
    assert r.returncode != 0 and "unrecognized arguments: --graph" in r.stderr


def test_graph_calls_defaults_and_validation():
    assert graph_calls(BenchConfig(), 8) == 20 and graph_calls(BenchConfig(), 64 << 20) == 4
    assert graph_calls(BenchConfig(), 1 << 30) == 1 and graph_calls(BenchConfig(graph_calls=7), 8) == 7
    with pytest.raises(ValueError, match="graph_calls"):
        BenchConfig(graph_calls=0)


def test_run_sweep_refuses_graph_timing_on_a_cpu_rank():
    from hpdl.bench.harness import run_sweep
    from hpdl.runtime.launch import Context

    ctx = Context.__new__(Context)  # the check comes before any communication: no group needed
    ctx.device = torch.device("cpu")
    with pytest.raises(ValueError, match="graph timing captures CUDA work"):
        run_sweep(ctx, BenchConfig(graph=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("collective,algorithms", [("allreduce", "native,auto,one_shot,two_shot"),
                                                    ("alltoall", "native,auto,push")])
def test_graph_timing_on_two_gpus(tmp_path, collective, algorithms):
    """Two ranks, each on its own GPU with NCCL; on a one-GPU host the two share it (``--ranks-per-gpu 2``):
    then native (gloo through host memory) cannot be captured and is left out, and the note is printed."""
    path = tmp_path / "g.json"
    shared = torch.cuda.device_count() < 2
    if shared:
        algorithms = algorithms.replace("native,", "")
    r = _bench(collective, "--device", "cuda", "--np", "2", "--graph", "--algorithms", algorithms, "-b", "1K",
               "-e", "4M", "-f", "64", "--json", str(path), *(["--ranks-per-gpu", "2"] if shared else []),
               timeout=500)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["meta"]["timing"] == "cuda-graph" and data["meta"]["ranks_per_gpu"] == (2 if shared else 1)
    assert ("are NOT multi-GPU performance" in r.stdout) == shared
    assert all(row["wrong"] == 0 and row["mode"] == "graph" and row["avg_us"] > 0 for row in data["rows"])


# ------------------------------------------------------------------ issue 37 item 8: --tune from a noisy sweep
def test_tune_refuses_a_sweep_its_own_footer_calls_noisy(tmp_path, monkeypatch, capsys):
    """`--tune` wrote a table from rows whose speed-ups the footer printed as ranges (> NOISE spread); it must
    refuse, say so, exit non-zero and leave an existing table alone. A clean sweep still writes one."""
    import hpdl.bench.cli as bench_cli
    from hpdl.bench.report import NoisySweepError, tuned_table

    quiet = [_row("native", 10.0, speedup=1.0, s_lo=1.0, s_hi=1.0),
             _row("ring", 5.0, speedup=2.0, s_lo=1.9, s_hi=2.1)]
    noisy = [quiet[0], _row("ring", 5.0, lo=2.0, hi=30.0, speedup=2.0, s_lo=0.3, s_hi=5.0)]
    assert noisy[1].noisy and not any(r.noisy for r in quiet)
    with pytest.raises(NoisySweepError, match="64 B"):
        tuned_table(noisy, 2, "cpu")
    out = tmp_path / "t.json"
    for rows, code in ((noisy, 1), (quiet, 0)):
        out.write_text("old")
        monkeypatch.setattr(bench_cli, "_launch", lambda cfg, args, rows=rows: (rows, 2))
        assert main(["bench", "allreduce", "--np", "2", "-b", "64", "-e", "64", "--algorithms", "native,ring",
                     "--tune", str(out)]) == code
        cap = capsys.readouterr()
        if code:
            assert "no tuning table written" in cap.err and "noisy" in cap.err and out.read_text() == "old"
            assert "0.30-5.00x" in cap.out   # the footer's range and the refusal come from the same rows
        else:
            assert "tuning table written" in cap.out and json.loads(out.read_text())["rules"]


# ------------------------------------------------------------------ issue 37 item 5: sizes too big for the host
@pytest.mark.parametrize("argv, flag", [
    (["--np", "2", "-b", "32G", "-e", "32G"], "-e/--max-bytes"),
    (["--np", "4096", "-b", "8", "-e", "8"], "--np"),
    (["--np", "2", "-b", "8", "-e", "1024G"], "-e/--max-bytes"),
])
def test_sizes_too_big_for_the_host_are_refused_before_spawning(argv, flag, monkeypatch, capsys):
    """`--np 2 -b 32G -e 32G` spawned ranks that died in an allocator (68 GB asked); it must fail before any
    process starts, naming the flag. The host is given 16 GiB free so the verdict does not depend on this one."""
    import hpdl.bench.cli as bench_cli
    import psutil

    real_vm = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real_vm()._replace(available=16 << 30))
    monkeypatch.setattr(bench_cli, "_launch", lambda cfg, args: pytest.fail("a rank was started"))
    assert main(["bench", "allreduce", *argv]) == 2
    err = capsys.readouterr().err
    assert f"choose a smaller {flag}" in err and "free" in err


def test_a_sweep_that_fits_is_not_refused(monkeypatch):
    import psutil

    from hpdl.bench.cli import _check_memory

    real_vm = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real_vm()._replace(available=16 << 30))
    args = build_parser("bench").parse_args(["bench", "allreduce", "--np", "4", "-e", "64M"])
    cfg = BenchConfig(collective="allreduce", sizes=[8, 64 << 20], algorithms=["native"])
    _check_memory(cfg, args)   # 4 x (300 MB + 2 x 64 MiB) fits in 16 GiB


def test_output_paths_are_checked_and_their_folders_made_before_the_sweep(tmp_path, monkeypatch, capsys):
    # before: --json/--plot/--tune in a missing folder ended the whole sweep in "FileNotFoundError" after it ran
    import hpdl.bench.cli as bench_cli

    def no_sweep(cfg, args):
        raise AssertionError("the sweep ran before the output paths were checked")

    monkeypatch.setattr(bench_cli, "_launch", no_sweep)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for flag in ("--json", "--plot", "--tune"):
        assert main(["bench", "allreduce", "--np", "1", "-b", "8", "-e", "8", flag, str(blocker / "r.out")]) == 2
        err = capsys.readouterr().err
        assert flag in err and "cannot make its folder" in err and "Traceback" not in err
    assert main(["bench", "allreduce", "--np", "1", "-b", "8", "-e", "8", "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    # a missing folder is made, then the sweep runs (here: the stand-in that refuses)
    main(["bench", "allreduce", "--np", "1", "-b", "8", "-e", "8", "--json", str(tmp_path / "new" / "a.json")])
    assert "the sweep ran" in capsys.readouterr().err and (tmp_path / "new").is_dir()
