"""``--format json``: stdout is one JSON document and nothing else, for every benchmark on the harness (progress
goes to stderr, docs/bench.md). Each plug-in runs in its smallest real mode in a fresh ``hpdl`` process, so that
output of spawned ranks (which write to the process's file descriptors, not to ``sys.stdout``) is caught too:
``hpdl moe bench`` printed a line per point to stdout from its rank 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

# the smallest run of each plug-in (the tiny arguments of its own tests)
RUNS = {
    "allreduce": ["bench", "allreduce", "--np", "2", "-b", "8", "-e", "8", "--algorithms", "native,ring",
                  "--iters", "2", "--warmup", "0", "--time-per-point", "0.01"],
    "overlap": ["bench", "overlap", "--np", "2", "--modes", "native", "-b", "1K", "-e", "1K", "--iters", "2",
                "--time-per-point", "0.01", "--timeout", "60"],
    "jacobi": ["offload", "jacobi", "--np", "2", "--sizes", "2x8x8", "--steps", "2", "--repeats", "1",
               "--modes", "blocking,thread", "--timeout", "60"],
    "apps": ["bench", "apps", "--np", "2", "--quick", "--rounds", "1"],
    "moe": ["moe", "bench", "--world-size", "2", "--experts", "4", "--batches", "1", "--hidden", "32", "--layers",
            "2", "--expert-size", "64", "--prompt-len", "8", "--new-tokens", "2", "--repeats", "1"],
    "serve": ["serve", "bench", "--config", "llama-tiny", "--num-requests", "2", "--prompt-len", "2:4",
              "--output-len", "2:2", "--max-seq-len", "32", "--num-slots", "2", "--systems", "flover"],
    "attention": ["bench", "attention", "--suite", "tokens", "-b", "64", "-e", "64", "--landmarks", "16",
                  "--heads", "2", "--head-dim", "16", "--methods", "soft,sdpa", "--warmup", "0", "--reps", "1"],
    "model": ["bench", "model"],
}


# over 5 s on a loaded 2-core machine: the slow tier (tests/conftest.py's threshold)
SLOW = {"allreduce", "overlap", "apps", "moe", "attention"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in RUNS])
def test_format_json_stdout_is_one_json_document(name, tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "hpdl.cli", *RUNS[name], "--format", "json"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)   # the whole of stdout: any progress line there fails this
    assert "meta" in doc, sorted(doc)
