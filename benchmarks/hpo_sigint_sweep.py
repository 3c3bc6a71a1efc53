"""Ctrl-C at many moments of `hpdl hpo run`'s first seconds (issue 37), on CPU.

Each try starts a study with `hpdl hpo run` in its own process group (as a terminal runs a foreground job),
sends SIGINT to the whole group after a given delay, and checks what a user sees:

* the driver exits within 5 s with status 130;
* stderr holds exactly one non-empty line, ``hpdl hpo: interrupted by SIGINT...``, and no traceback;

then runs the command that line names (``resume``, or ``run`` when nothing was stored yet) and checks that the
budget finished with one trial per configuration: ``n_trials`` trials, each COMPLETE or PRUNED, no FAIL, no
configuration twice (``hpdl_lineage``).

    python benchmarks/hpo_sigint_sweep.py --out /tmp/sweep              # full: 0.5 s steps to 8 s, 20 tries
    python benchmarks/hpo_sigint_sweep.py --moments 0.5,3 --tries 1 --tiny --out /tmp/sweep   # a smoke run

Defaults: the shipped example study (6 configurations, `hpdl hpo run` without a file); ``--tiny`` shortens
its training (10 steps) and uses 3 configurations. Writes ``sweep.json`` and ``sweep.log`` under ``--out``
and prints a table per moment last. CPU only (fake devices); nothing here needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

LINE = re.compile(r"^hpdl hpo: interrupted by SIGINT\b")
EXIT_LIMIT_S = 5.0


def study_file(folder: Path, tiny: bool) -> Path | None:
    """The study to run: None for the shipped example, else a shortened copy of it written into ``folder``."""
    if not tiny:
        return None
    import yaml

    d = yaml.safe_load(resources.files("hpdl.hpo").joinpath("examples/quick.yaml").read_text())
    d["n_trials"] = 3
    d["fixed"] = {**d["fixed"], "steps": 10, "eval_every": 5}
    d["pruner"] = {"name": "none"}
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def _env() -> dict:
    src = Path(__file__).resolve().parents[1] / "src"
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(src), *sys.path])}


def _cmd(verb: str, study: Path | None, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "hpdl.cli", "hpo", verb, *([str(study)] if study else []), "--run-dir",
            str(run_dir), "--no-progress"]


def check_store(run_dir: Path, study: Path | None) -> tuple[bool, str]:
    """(ok, why): the finished study has one trial per configuration, each COMPLETE or PRUNED."""
    import optuna
    import yaml

    d = yaml.safe_load(Path(study).read_text() if study else
                       resources.files("hpdl.hpo").joinpath("examples/quick.yaml").read_text())
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s = optuna.load_study(study_name=d["study"], storage=f"sqlite:///{run_dir / 'study.db'}")
    trials = s.get_trials(deepcopy=False)
    states = [t.state.name for t in trials]
    lineages = [t.user_attrs.get("hpdl_lineage", t.number) for t in trials]
    ok = (len(trials) == d["n_trials"] and set(states) <= {"COMPLETE", "PRUNED"}
          and len(set(lineages)) == len(lineages))
    return ok, f"{len(trials)} trials for {d['n_trials']} configurations, states {sorted(states)}"


def interrupt_once(delay_s: float, folder: Path, study: Path | None, resume_timeout_s: float = 300.0,
                   exit_limit_s: float = EXIT_LIMIT_S) -> dict:
    """One try: start, SIGINT the process group after ``delay_s``, check the exit, continue, check the store."""
    run_dir = folder / f"run-{int(delay_s * 1000)}ms-{time.monotonic_ns()}"
    err_path = folder / f"{run_dir.name}.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(_cmd("run", study, run_dir), env=_env(), stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)  # its own process group, as a terminal's job
        time.sleep(delay_s)
        if proc.poll() is not None:  # the study ended before this moment: nothing was interrupted
            return {"delay_s": delay_s, "rc": proc.returncode, "exit_s": 0.0, "finished_before": True,
                    "ok": proc.returncode == 0, "problems": [] if proc.returncode == 0 else
                    [f"ended with {proc.returncode} before the signal: {err_path.read_text()[-300:]}"]}
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(exit_limit_s + 10)
        except subprocess.TimeoutExpired:
            pass
        took = time.monotonic() - t0
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err_path.read_text()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    row = {"delay_s": delay_s, "rc": proc.returncode, "exit_s": round(took, 2), "stderr": text[-1500:]}
    problems = []
    if proc.returncode == 0:
        problems.append("the interrupt was swallowed: the study ran to its end, exit 0")
    elif proc.returncode != 130:
        problems.append(f"exit status {proc.returncode}, expected 130")
    if took > exit_limit_s:
        problems.append(f"took {took:.1f} s to exit (> {exit_limit_s} s)")
    if "Traceback" in text or "Error" in text:
        problems.append("a traceback or error on stderr")
    if len(lines) != 1 or not LINE.match(lines[0]):
        problems.append(f"{len(lines)} stderr lines, expected the one 'hpdl hpo: interrupted by SIGINT' line")
    if "`hpdl hpo resume" in text:
        verb = "resume"
    elif "`hpdl hpo run" in text:
        verb = "run"
    else:  # the line names no command (the study had finished): `resume` of a stored study reports it
        verb = "resume" if (run_dir / "study.db").exists() else "run"
    if proc.returncode == 0:
        verb = None  # nothing to continue
    if verb is not None:
        cont = subprocess.run(_cmd(verb, study, run_dir), env=_env(), capture_output=True, text=True,
                              timeout=resume_timeout_s)
        row["continued_with"] = verb
        if cont.returncode != 0:
            problems.append(f"`hpdl hpo {verb}` exited {cont.returncode}: {cont.stderr.strip()[-300:]}")
    try:
        ok, why = check_store(run_dir, study)
        row["store"] = why
        if not ok:
            problems.append(f"store after the continuation: {why}")
    except Exception as exc:  # noqa: BLE001 - reported as this try's problem
        problems.append(f"store unreadable: {exc!r}")
    row["problems"] = problems
    row["ok"] = not problems
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moments", default=",".join(f"{0.5 * i:g}" for i in range(1, 17)),
                    help="comma-separated delays in s before SIGINT (default: 0.5 s steps to 8 s)")
    ap.add_argument("--tries", type=int, default=20, help="tries per moment (default: %(default)s)")
    ap.add_argument("--tiny", action="store_true", help="3 configurations of 10 steps instead of the example")
    ap.add_argument("--out", default=None, help="folder for sweep.json and sweep.log (default: a temporary one)")
    a = ap.parse_args()
    moments = [float(x) for x in a.moments.split(",")]
    if a.tries < 1 or any(not 0 <= m <= 600 for m in moments):
        ap.error("--tries must be >= 1 and every moment in [0, 600] s")
    out = Path(a.out or tempfile.mkdtemp(prefix="hpo-sigint-"))
    out.mkdir(parents=True, exist_ok=True)
    study = study_file(out, a.tiny)
    rows = []
    with open(out / "sweep.log", "w") as log:
        for m in moments:
            for i in range(a.tries):
                r = interrupt_once(m, out, study)
                rows.append(r)
                log.write(json.dumps(r) + "\n")
                log.flush()
                print(f"{m:5.1f} s try {i + 1:2d}: {'ok' if r['ok'] else 'FAIL ' + '; '.join(r['problems'])}",
                      flush=True)
    (out / "sweep.json").write_text(json.dumps({"moments": moments, "tries": a.tries, "tiny": a.tiny,
                                                "rows": rows}, indent=1))
    print(f"\n{'moment s':>9} {'tries':>6} {'ok':>4} {'max exit s':>11}  continued with")
    for m in moments:
        rs = [r for r in rows if r["delay_s"] == m]
        verbs = sorted({r.get("continued_with", "finished first" if r.get("finished_before") else "-") for r in rs})
        print(f"{m:9.1f} {len(rs):6d} {sum(r['ok'] for r in rs):4d} {max(r['exit_s'] for r in rs):11.2f}  "
              f"{','.join(verbs)}")
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} tries ok; results in {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
