import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpdl.bench.cli import parse_size, sizes_between
from hpdl.bench.harness import Row
from hpdl.bench.report import format_table, tuned_table
from hpdl.bench.verify import count_wrong, expected, make_input

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8])
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max", "product"])
def test_expected_matches_float64_brute_force(dtype, op):
    if op == "avg" and not dtype.is_floating_point:
        return
    p, n = 16, 1000
    vals = torch.stack([make_input(r, n, op, dtype).double() for r in range(p)])
    ref = {"sum": vals.sum(0), "avg": vals.sum(0) / p, "min": vals.min(0).values, "max": vals.max(0).values,
           "product": vals.prod(0)}[op]
    if dtype == torch.uint8 and op in ("sum", "product"):
        ref = torch.remainder(ref, 256)
    assert count_wrong(expected(p, n, op, dtype), ref.to(dtype)) == 0
    if op in ("sum", "product") and dtype.is_floating_point:
        assert ref.abs().max() <= 256  # exact in bfloat16: any order gives the same bits


def test_count_wrong_counts_each_bad_element():
    want = torch.arange(10.0)
    got = want.clone()
    got[[2, 7]] = -1
    assert count_wrong(got, want) == 2
    assert count_wrong(torch.full((3,), float("nan")), torch.zeros(3)) == 3


def test_parse_size_and_sweep():
    assert parse_size("8") == 8 and parse_size("64K") == 65536 and parse_size("1MiB") == 1 << 20
    assert sizes_between(8, 64) == [8, 16, 32, 64]
    with pytest.raises(ValueError):
        sizes_between(64, 8)


def _row(size, algo, us, wrong=0, resolved=None):
    return Row(size, size // 4, "float32", "sum", algo, resolved or algo, None, us, us, us, 1.0, 1.0, wrong, 5)


def test_tuned_table_prefers_native_within_noise_and_skips_wrong():
    rows = [_row(8, "native", 10), _row(8, "recursive_doubling", 9.8), _row(8, "direct", 5, wrong=3),
            _row(1 << 20, "native", 100), _row(1 << 20, "direct", 60), _row(4 << 20, "native", 400),
            _row(4 << 20, "direct", 250)]
    table = tuned_table(rows, 4, "cpu")
    assert table.select(8, 4, "cpu")[0] == "native"  # 2% faster is noise; direct was wrong
    assert table.select(1 << 20, 4, "cpu")[0] == "direct"
    assert table.select(1 << 30, 4, "cpu")[0] == "direct"
    assert table.select(8, 6, "cpu")[0] != "direct"  # other world sizes keep the defaults


def test_table_has_the_known_columns():
    text = format_table([_row(8, "native", 10.0)])
    assert "size(B)" in text and "busbw(GB/s)" in text and "#wrong" in text and "Out of bounds values : 0 OK" in text
    # the ratio's direction is in the header, not only in a note under the table
    assert text.splitlines()[0].endswith("vs native (speed-up, higher is better)")


def _readme_main_command() -> str:
    """The README's first set-up command, minus its install step."""
    text = (ROOT / "README.md").read_text()
    line = next(l for l in text.splitlines() if "hpdl bench allreduce" in l and "pip install" in l)
    return line.split("&&", 1)[1].strip()


@pytest.mark.timeout(600)
def test_readme_main_command_prints_a_correct_table(tmp_path):
    cmd = _readme_main_command()
    assert cmd.startswith("hpdl bench allreduce")
    out = subprocess.run(shlex.split(cmd) + ["--json", str(tmp_path / "r.json")], capture_output=True, text=True,
                         timeout=580, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [l for l in out.stdout.splitlines() if l and not l.startswith("#")]
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["meta"]["world_size"] == 4 and data["meta"]["device"] == "cpu"
    sizes = sorted({r["size"] for r in data["rows"]})
    assert sizes[0] == 8 and sizes[-1] == 64 << 20
    assert len(rows) == len(data["rows"]) and all(r["wrong"] == 0 for r in data["rows"])
    assert {r["algorithm"] for r in data["rows"]} >= {"native", "direct", "ring"}
    assert re.search(r"Out of bounds values : 0 OK", out.stdout)


@pytest.mark.timeout(300)
def test_cli_usage_errors_exit_2_as_argparse():
    r = subprocess.run([sys.executable, "-m", "hpdl.cli", "bench", "allreduce", "--np", "0"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "argument --np: must be an integer in [1, " in r.stderr   # argparse's usage error
    r = subprocess.run([sys.executable, "-m", "hpdl.cli", "bench", "allreduce", "--algorithms", "foo"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "foo" in r.stderr   # the harness's check before the run: the same status
