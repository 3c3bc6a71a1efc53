"""The experiment harness (hpdl.bench.common) every benchmark plug-in runs on: metadata, tables, plots,
progress, output flags and the exit status, through a tiny plug-in."""

from __future__ import annotations

import argparse
import io
import json
import re

import pytest

from hpdl.bench import common as C
from hpdl.runtime.errors import CLIUsageError


class Squares(C.Benchmark):
    """A plug-in in 20 lines: squares of -b..-e, one row wrong when asked."""

    name = "squares"
    title = "n^2 by two methods"
    columns = (C.Column("n", "n"), C.Column("method", "method"), C.Column("ms", "time", "ms", ".2f"),
               C.Column("speedup", "vs mul", fmt=".2f", ratio="speed-up"), C.Column("wrong", "#wrong"))
    plot_spec = C.PlotSpec(x="n", xlabel="n", panels=(C.Panel("ms", "time (ms)", "log"),), series="method",
                           xscale="log2")

    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument("-b", type=int, default=1)
        parser.add_argument("-e", type=int, default=8)
        parser.add_argument("--break-one", action="store_true")

    def validate(self, args):
        if args.b > args.e:
            raise CLIUsageError(f"-b ({args.b}) must not exceed -e ({args.e})")

    def metadata(self, args):
        return {"range": [args.b, args.e]}

    def run(self, ctx):
        rows, n = [], ctx.args.b
        with ctx.progress(4, header="# squares") as bar:
            while n <= ctx.args.e:
                for method, t in (("mul", 2.0), ("pow", 1.0)):
                    got = n ** 2 + (1 if ctx.args.break_one and n == ctx.args.e and method == "pow" else 0)
                    rows.append({"n": n, "method": method, "ms": t * n, "speedup": 2.0 / t,
                                 "wrong": int(got != n * n)})
                bar.advance(f"n={n}")
                n *= 2
        return rows


def _run(argv):
    parser = argparse.ArgumentParser()
    cmd = C.command(Squares)
    cmd.add_arguments(parser)
    return cmd().run(parser.parse_args(argv))


def test_metadata_is_utc_and_names_the_run():
    meta = C.run_metadata(device="cpu", command="hpdl bench x", versions=("numpy", "no_such_module"), k=1)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", meta["date"])
    assert meta["command"] == "hpdl bench x" and meta["device"] == "cpu" and meta["k"] == 1
    assert {"host", "cpu", "cores", "python", "torch", "commit", "numpy"} <= set(meta)
    assert "no_such_module" not in meta and "gpu" not in meta


def test_invocation_is_the_command_as_typed():
    """Alias commands head their tables with what was typed (`hpdl moe bench` printed `# hpdl bench moe`)."""
    assert C.invocation({"command": "hpdl moe bench --world-size 2"}, "hpdl bench moe") == "hpdl moe bench"
    assert C.invocation({"command": "hpdl --debug bench all_reduce --np 2"}, "x") == "hpdl bench all_reduce"
    assert C.invocation({"command": "hpdl offload jacobi"}, "x") == "hpdl offload jacobi"
    assert C.invocation({"command": "python3 benchmarks/apps_cpu.py OUT"}, "hpdl bench apps") == "hpdl bench apps"
    assert C.invocation({}, "hpdl bench x") == "hpdl bench x"


def test_table_has_units_and_says_which_way_a_ratio_is_better():
    text = C.format_table([{"n": 1, "method": "a-very-long-method-name", "ms": 1.234, "speedup": 2.0, "wrong": 0},
                           {"n": 2, "method": "b", "ms": None, "speedup": None, "wrong": 0}], Squares.columns, "t")
    lines = text.splitlines()
    assert lines[0] == "# t" and "time (ms)" in lines[1] and "vs mul (speed-up, higher is better)" in lines[1]
    assert "a-very-long-method-name" in text and "2.00x" in text and " - " in text + " "
    assert lines[-1] == "# vs mul: speed-up (the reference's time / this row's): higher is better"
    with pytest.raises(ValueError, match="ratio"):
        C.Column("x", "x", ratio="faster")


def test_progress_lines_off_a_terminal_and_silent_when_disabled():
    stream = io.StringIO()
    p = C.Progress(2, "x", stream=stream, header="# start")
    assert p.mode == "lines"
    p.advance("first")
    p.note("phase two")
    p.advance("second")
    p.close()
    assert stream.getvalue().splitlines() == ["# start", "[1/2] first", "# phase two", "[2/2] second"]
    few = io.StringIO()
    p = C.Progress(100, stream=few, lines=4)
    for i in range(1, 101):
        p.update(i, f"step {i}")
    p.resize(200)
    p.update(200, "end")
    assert few.getvalue().splitlines() == ["[25/100] step 25", "[50/100] step 50", "[75/100] step 75",
                                           "[100/100] step 100", "[200/200] end"]
    quiet = io.StringIO()
    C.Progress(2, stream=quiet, enabled=False).advance("x")
    assert quiet.getvalue() == ""
    with pytest.raises(ValueError, match="mode"):
        C.Progress(1, mode="fancy")


def test_plugin_run_writes_every_output_and_exits_by_wrong(tmp_path, capsys):
    out, js, png = tmp_path / "out", tmp_path / "j" / "r.json", tmp_path / "p" / "r.png"
    assert _run(["-b", "2", "-e", "8", "--out", str(out), "--json", str(js), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# hpdl bench squares: n^2 by two methods; device cpu") and "# wrote" in text
    doc = json.loads(js.read_text())
    assert doc["meta"]["range"] == [2, 8] and doc["meta"]["date"].endswith("UTC") and len(doc["rows"]) == 6
    assert json.loads((out / "squares.json").read_text())["rows"] == doc["rows"]
    assert (out / "squares.png").stat().st_size > 5000 and png.stat().st_size > 5000
    assert _run(["-e", "4", "--break-one", "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert sum(r["wrong"] for r in doc["rows"]) == 1


def test_bad_arguments_and_outputs_are_refused_before_the_run(tmp_path):
    with pytest.raises(CLIUsageError, match=r"-b \(9\) must not exceed -e"):
        _run(["-b", "9", "-e", "2"])
    with pytest.raises(CLIUsageError, match="--json .*is a folder"):
        _run(["--json", str(tmp_path)])
    (tmp_path / "f").write_text("")
    with pytest.raises(CLIUsageError, match="--out .*is a file"):
        _run(["--out", str(tmp_path / "f")])


def test_pyplot_is_agg():
    import matplotlib

    C.pyplot()
    assert matplotlib.get_backend().lower() == "agg"


def test_subsystem_benches_are_plugins_under_hpdl_bench(capsys):
    """apps and moe run under `hpdl bench` through the harness: their checks fail before any rank starts, with
    argparse's usage status 2 (1 is for a wrong row), naming the flags."""
    from hpdl.cli import main

    assert main(["bench", "apps", "--np", "2,x"]) == 2
    assert "--np must be comma-separated process counts" in capsys.readouterr().err
    assert main(["bench", "moe", "--world-size", "3", "--experts", "8"]) == 2
    assert "--world-size 3 must divide every expert count" in capsys.readouterr().err
    assert main(["bench", "attention", "-b", "9", "-e", "8"]) == 2
    assert "-b/--min-tokens (9) must not exceed -e/--max-tokens (8)" in capsys.readouterr().err


def test_shared_flag_spellings_are_aliases_where_a_bench_had_its_own():
    """--np (ranks) and --repeats take the same meaning in every bench; the older spellings still parse."""
    from hpdl.cli import build_parser

    moe = build_parser("moe")
    assert moe.parse_args(["moe", "bench", "--np", "2"]).world_size == 2
    assert moe.parse_args(["moe", "bench", "--world-size", "2"]).world_size == 2
    bench = build_parser("bench")
    assert bench.parse_args(["bench", "attention", "--repeats", "3"]).reps == 3
    assert bench.parse_args(["bench", "attention", "--reps", "3"]).reps == 3
