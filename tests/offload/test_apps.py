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
])
def test_command_usage_errors(argv, msg, capsys):
    assert main(argv) == 1
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
    assert "Eff.ovl(%)" in text.splitlines()[0]
    assert text.splitlines()[1].split()[-2] == "0.0"  # the effective column, before #wrong
