"""The Jacobi kernel's overlap split and the benchmark commands' argument checks (no processes)."""

import itertools

import pytest
import torch

from hpdl.cli import main
from hpdl.offload.jacobi import boxes, stencil


@pytest.mark.parametrize("shape", [(4, 5, 6), (1, 3, 3), (2, 2, 2), (3, 1, 4)])
def test_interior_and_shell_cover_the_block_once_and_compute_the_same_bits(shape):
    torch.manual_seed(0)
    u = torch.rand(tuple(n + 2 for n in shape))
    b = torch.rand(shape)
    full = tuple(slice(1, n + 1) for n in shape)
    want = torch.zeros_like(u)
    stencil(u, want, b, full)
    for exchanged in itertools.product([True, False], repeat=3):
        inner, shell = boxes(shape, exchanged)
        count = torch.zeros_like(u)
        got = torch.zeros_like(u)
        for box in [inner, *shell]:
            count[box] += 1
            stencil(u, got, b, box)
        assert (count[full] == 1).all() and count.sum() == count[full].sum(), exchanged
        assert torch.equal(got, want), exchanged  # split update == whole update, bit for bit


@pytest.mark.parametrize("argv,msg", [
    (["offload", "jacobi", "--modes", "agent,fast"], "--modes must be from"),
    (["offload", "jacobi", "--np", "4", "--grid", "2x1x1"], "has 2 ranks but --np is 4"),
    (["offload", "jacobi", "--sizes", "4x4"], "expected 3 positive extents"),
    (["bench", "overlap", "--modes", "mpi"], "--modes must be from"),
    (["bench", "overlap", "--np", "1"], "--np must be >= 2"),
    (["offload", "agent", "--agents", "2"], "--rendezvous HOST:PORT is needed"),
    (["bench", "overlap", "-b", "2K", "-e", "1K"], "-b/--min-bytes (2048) must not exceed -e/--max-bytes (1024)"),
    (["bench", "overlap", "--np", "2", "-e", "1024G"], "-e/--max-bytes/--np"),
    (["bench", "jacobi", "--sizes", ","], "--sizes must name at least one block shape"),
    (["offload", "jacobi", "--sizes", "4xAx4"], "--sizes/--grid"),
    (["offload", "jacobi", "--json", "/proc/x/y.json"], "--json /proc/x/y.json"),
])
def test_command_usage_errors(argv, msg, capsys):
    # the benchmarks' checks run in the bench harness before the run: argparse's usage status, 2
    assert main(argv) == (1 if argv[:2] == ["offload", "agent"] else 2)
    assert msg in capsys.readouterr().err


def test_overlap_table_reports_effective_overlap_against_compute_alone():
    from hpdl.offload.bench import format_table, overlap_pct

    # progress slowed the compute from 1000 to 1400 us: OSU's number credits that, the effective one does not
    row = {"size": 65536, "mode": "agent", "overall_us": 1500.0, "compute_us": 1400.0, "pure_comm_us": 500.0,
           "overlap_pct": overlap_pct(1500.0, 1400.0, 500.0), "compute_alone_us": 1000.0, "wrong": 0}
    assert row["overlap_pct"] == 80.0
    assert overlap_pct(1500.0, 1000.0, 500.0) == 0.0
    assert overlap_pct(1200.0, 1000.0, 500.0) == 60.0
    assert overlap_pct(1.0, 1.0, 0.0) == 0.0
    text = format_table([row])
    header, rule, line = text.splitlines()[:3]
    assert "Eff.ovl (%)" in header and set(rule) == {"-"}
    assert line.split()[-2] == "0.0"  # the effective column, before #wrong


def test_overlap_sizes_take_nccl_tests_flags_and_the_old_ones():
    """-b/-e/-f as nccl-tests (the docs' spelling); --min/--max, this command's first spelling, still parse."""
    from hpdl.cli import build_parser

    parser = build_parser("bench")
    new = parser.parse_args(["bench", "overlap", "-b", "4K", "-e", "1M", "-f", "2"])
    old = parser.parse_args(["bench", "overlap", "--min", "4K", "--max", "1M", "--factor", "2"])
    assert (new.min_size, new.max_size, new.factor) == (old.min_size, old.max_size, old.factor) == (4096, 1 << 20, 2)


def test_jacobi_table_labels_its_ratio_as_a_time_ratio():
    """``vs blocking`` is this mode's step time over blocking's: the header and the note say lower is better."""
    import argparse

    from hpdl.bench.common import RunContext, run_metadata
    from hpdl.offload.jacobi import JacobiBenchmark

    bench = JacobiBenchmark()
    args = argparse.Namespace(np=2, sizes="2x8x8", grid=None, modes="blocking,agent", dtype="float32")
    bench.validate(args)
    rows = [{"shape": "2x8x8", "cells": 128, "mode": "blocking", "step_ms": 2.0, "comm_ms": 1.0, "wrong": 0,
             "executor": "torch.distributed", "vs_blocking": 1.0, "comm_fraction": 0.5},
            {"shape": "2x8x8", "cells": 128, "mode": "agent", "step_ms": 1.0, "comm_ms": 0.2, "wrong": 0,
             "executor": "native", "vs_blocking": 0.5, "comm_fraction": None}]
    text = bench.table(rows, RunContext(args, run_metadata(), bench))
    assert "vs blocking (time ratio, lower is better)" in text
    assert "# vs blocking: time ratio (this row's time / the reference's): lower is better" in text
    agent = next(line for line in text.splitlines() if " agent " in line)
    assert agent.split()[2:6] == ["1.000", "0.200", "-", "0.50x"]
