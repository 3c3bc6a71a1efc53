"""End-to-end fuzz of the README tour's numeric flags (issue 37: "no command of the tour hangs on any argument
value"). Not collected by pytest (minutes, not seconds); test_cli_numeric_flags.py is its CI part.

    PYTHONPATH=src python3 tests/cli_fuzz_e2e.py --out fuzz.json [--limit 30] [--only "moe train"]

Every numeric flag of every tour command (hpo and tes included) gets 0, -1 and 1e21, appended to a small,
fast base invocation of that command (so a valid value gives a result in seconds; the last occurrence of a flag
wins in argparse). A value the parser refuses is recorded as a usage error without starting a process (the
parse is the same code the process would run); every other case runs as ``python -m hpdl.cli ...`` (or the
example script) in its own process group, killed after ``--limit`` seconds. Outcomes: ``usage`` (exit 2 at
parse), ``error`` (exit 1 with a one-line message), ``result`` (exit 0), ``served`` (``hpdl serve`` came up and
was stopped), ``traceback`` (exit != 0 with a Python traceback: a defect) and ``hang`` (killed at the limit: a
defect). Prints a summary table last; exits 1 if any case hung or ended in a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_cli_numeric_flags import HUGE, _numeric_flags, _parser, _subparser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VALUES = ("0", "-1", HUGE)


def bases(tmp: Path) -> dict[str, list[str]]:
    """A fast, valid invocation of each tour command (inputs made by ``setup``; every output path holds
    ``@CASE@``, replaced by the case's number, so that no case sees another's files)."""
    data = sysconfig.get_paths()["stdlib"] + "/typing.py"
    return {
        "bench allreduce": ["--np", "2", "-b", "8", "-e", "64", "--iters", "3", "--warmup", "0",
                            "--time-per-point", "0.001", "--algorithms", "native,ring"],
        "bench alltoall": ["--np", "2", "-b", "8", "-e", "64", "--iters", "3", "--warmup", "0",
                           "--time-per-point", "0.001", "--algorithms", "native,pairwise"],
        "bench overlap": ["--np", "2", "-b", "1K", "-e", "1K", "--iters", "3", "--time-per-point", "0.01",
                          "--modes", "native"],
        "bench attention": ["--device", "cpu", "--suite", "tokens", "--min-tokens", "64", "--max-tokens", "64",
                            "--methods", "soft", "--reps", "1", "--warmup", "0", "--out", str(tmp / "att-@CASE@")],
        "bench serve": ["--config", "llama-tiny", "--num-requests", "2", "--prompt-len", "4", "--output-len", "2",
                        "--max-seq-len", "64", "--num-slots", "2", "--systems", "flover", "--format", "json"],
        "offload jacobi": ["--np", "2", "--sizes", "2x8x8", "--steps", "2", "--repeats", "1", "--modes", "blocking"],
        "moe train": ["--steps", "1", "--batch", "2", "--seq", "16", "--hidden", "16", "--layers", "2",
                      "--experts", "2", "--checkpoints", "2", "--max-bytes", "400000", "--out", str(tmp / "mt-@CASE@")],
        "moe trace": ["--model", str(tmp / "moe"), "--tokens", "64", "--seq", "16", "--out", str(tmp / "t-@CASE@.npz")],
        "moe place": [str(tmp / "trace.npz"), "--world-size", "2", "--out", str(tmp / "p-@CASE@.json"),
                      "--method", "greedy"],
        "moe bench": ["--world-size", "2", "--experts", "2", "--batches", "1", "--hidden", "16", "--layers", "2",
                      "--expert-size", "16", "--prompt-len", "4", "--new-tokens", "1", "--repeats", "1",
                      "--out", str(tmp / "mb-@CASE@.json")],
        "serve": ["--config", "llama-tiny", "--port", "0", "--max-seq-len", "64", "--num-slots", "2"],
        "vision train": ["--model", "soft_tiny", "--device", "cpu", "--max-steps", "1", "--batch-size", "2",
                         "--image-size", "32", "--workers", "0", "--out", str(tmp / "vt-@CASE@")],
        "vision evaluate": ["--model", "soft_tiny", "--checkpoint", str(tmp / "vision" / "checkpoint.pt"),
                            "--device", "cpu", "--workers", "0", "--batch-size", "4"],
        "vision make-shapes": ["--root", str(tmp / "shapes-@CASE@"), "--train", "2", "--val", "1", "--image-size", "32"],
        "hpo simulate": ["--pool", "2xA100", "--format", "json"],
        "tes simulate": ["--out", str(tmp / "tes-@CASE@")],
        "examples/train_gpt.py": ["--steps", "2", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                                  "--block-size", "16", "--batch-size", "2", "--data", data],
        "examples/cg.py": ["--size", "4", "--iters", "2", "--warmup", "0"],
        "examples/fft3d.py": ["--shape", "4,4,4", "--iters", "1", "--warmup", "0"],
    }


def argv_of(command: str, base: list[str]) -> list[str]:
    if command.startswith("examples/"):
        return [sys.executable, str(ROOT / command), *base]
    return [sys.executable, "-m", "hpdl.cli", *command.split(), *base]


def run(argv: list[str], limit: float, env: dict, cwd: Path, serve: bool = False) -> dict:
    """Run one case in its own process group; kill the group at ``limit`` seconds."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rc = None
    seconds = time.monotonic() - t0
    if rc is None:
        outcome = "served" if serve and " on http://" in out else "hang"
    elif rc == 0:
        outcome = "result"
    elif "Traceback (most recent call last)" in err:
        outcome = "traceback"
    elif rc == 2:
        outcome = "usage"
    else:
        outcome = "error"
    last = (err.strip().splitlines() or out.strip().splitlines() or [""])[-1]
    return {"rc": rc, "outcome": outcome, "seconds": round(seconds, 1), "last_line": last[:300]}


def setup(tmp: Path, env: dict) -> None:
    """Files the bases need: a tiny MoE, its trace, a SOFT checkpoint."""
    py = [sys.executable, "-m", "hpdl.cli"]
    steps = [
        py + ["moe", "train", "--steps", "1", "--batch", "2", "--seq", "16", "--hidden", "16", "--layers", "2",
              "--experts", "2", "--checkpoints", "2", "--max-bytes", "400000", "--out", str(tmp / "moe")],
        py + ["moe", "trace", "--model", str(tmp / "moe"), "--tokens", "256", "--seq", "16",
              "--out", str(tmp / "trace.npz")],
        py + ["vision", "train", "--model", "soft_tiny", "--device", "cpu", "--max-steps", "1", "--batch-size", "2",
              "--image-size", "32", "--workers", "0", "--out", str(tmp / "vision")],
    ]
    for argv in steps:
        r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
        if r.returncode:
            raise SystemExit(f"setup failed: {' '.join(argv)}\n{r.stderr[-2000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="cli_fuzz.json", help="JSON of every case")
    ap.add_argument("--limit", type=float, default=30.0, help="seconds a case may run")
    ap.add_argument("--only", default=None, help="fuzz only this command (e.g. 'moe train')")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpdl-fuzz-") as d:
        tmp = Path(d)
        setup(tmp, env)
        for command, base in bases(tmp).items():
            if args.only and command != args.only:
                continue
            parser, prefix = _parser(command)
            for flag in _numeric_flags(_subparser(parser, prefix)):
                for value in VALUES:
                    case = [a.replace("@CASE@", str(len(rows))) for a in base]
                    argv = argv_of(command, case + [flag, value])
                    err = io.StringIO()
                    try:
                        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                            parser.parse_args(prefix + case + [flag, value])
                        parsed = True
                    except SystemExit:
                        parsed = False
                    if not parsed:
                        row = {"rc": 2, "outcome": "usage", "seconds": 0.0,
                               "last_line": err.getvalue().strip().splitlines()[-1][:300]}
                    else:
                        row = run(argv, args.limit, env, tmp, serve=command == "serve")
                    row.update(command=command, flag=flag, value=value)
                    rows.append(row)
                    print(f"{row['outcome']:>9} {row['seconds']:6.1f}s  {command} {flag} {value[:6]}: "
                          f"{row['last_line'][:110]}", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r["outcome"] in ("hang", "traceback")]
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ("usage", "error", "result", "served", "traceback",
                                                                "hang")}
    print(f"\n{'cases':>6} " + " ".join(f"{k:>9}" for k in counts))
    print(f"{len(rows):>6} " + " ".join(f"{v:>9}" for v in counts.values()))
    print(f"longest case: {max((r['seconds'] for r in rows), default=0):.1f} s; defects: {len(bad)}")
    for r in bad:
        print(f"  {r['outcome']}: {r['command']} {r['flag']} {r['value']}: {r['last_line'][:150]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
