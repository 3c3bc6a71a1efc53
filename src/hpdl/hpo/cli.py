"""``hpdl hpo``: run, resume and inspect studies; simulate policies on pools we cannot run.

    hpdl hpo run [study.yaml] [--policy pack] [--no-progress]   # default: the shipped CPU example
    hpdl hpo resume study.yaml
    hpdl hpo status study.yaml | --storage URL --study NAME [--format json]
    hpdl hpo simulate --pool 12xA100,4xH100 [--trials trace.json] [--mps] [--plot out.png] [--policies pack+fuse]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from importlib import resources

from hpdl.bench.common import add_output_arguments
from hpdl.runtime.commands import CommandGroup
from hpdl.runtime.errors import CLIUsageError


_EXIT_DEADLINE_S = 4.5  # after SIGINT/SIGTERM the command exits within this, stopped cleanly or not


class _StartupStop(BaseException):
    """SIGINT/SIGTERM before the driver's loop took over: a BaseException, so that no ``except Exception``
    of the start-up can swallow it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _again(args, spec) -> str:
    """The command that continues after an interrupt: ``resume`` once the study is in its store (read with
    the standard library's sqlite3, so an exiting process does not wait on a storage layer), else ``run``
    (nothing was stored). A server storage is assumed to hold it once the spec was read."""
    stored = False
    if spec is not None:
        from hpdl.hpo.spec import sqlite_path

        db = sqlite_path(spec.storage)
        if db is None:
            stored = True
        elif db.exists():
            import sqlite3

            try:
                con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=0.2)
                try:
                    stored = con.execute("SELECT 1 FROM studies WHERE study_name = ?", (spec.study,)).fetchone() \
                        is not None
                finally:
                    con.close()
            except sqlite3.Error:
                stored = False
    return _command(args, "resume" if stored else "run")


def _command(args, verb: str) -> str:
    """``hpdl hpo VERB`` with the study file and ``--run-dir`` this command was given (a bare ``hpdl hpo resume``
    would continue the shipped example, not this study)."""
    cmd = f"hpdl hpo {verb}"
    if args.study_file:
        cmd += f" {args.study_file}"
    if getattr(args, "run_dir", None):
        cmd += f" --run-dir {args.run_dir}"
    return cmd


def _clocks_line(res) -> str:
    """The run summary's two clocks (:class:`hpdl.hpo.driver.StudyResult`): ready (from a ready warm pool to
    the budget's end) and counted in (from the process's start to the end of the teardown), and what lies
    between them."""
    ph = res.setup_phases
    return (f"clocks: ready {res.wall_s:.1f} s, counted in {res.counted_s:.1f} s (before ready {res.setup_s:.1f} s: "
            f"start-up and imports {ph.get('before_driver', 0.0):.1f}, study set-up {ph.get('driver', 0.0):.1f}, "
            f"warm pool {ph.get('pool', res.warmup_s):.1f}; teardown {res.teardown_s:.1f} s)")


def _where(r: dict) -> str:
    """Where a running trial is, for ``status``: asked but not yet started by a worker has no host, device or
    step (this printed "on None/None at step None")."""
    if r["host"] is None:
        return "(asked, not yet started on a worker)"
    step = f"at step {r['last_step']}" if r["last_step"] is not None else "before its first report"
    return f"on {r['host']}/{r['device']} {step}"


def _example() -> str:
    return str(resources.files("hpdl.hpo").joinpath("examples/quick.yaml"))


class HpoCommand(CommandGroup):
    """``hpdl hpo {run,resume,status,simulate}``."""

    dest, subcommands = "hpo_cmd", ("run", "resume", "status", "simulate")

    @classmethod
    def add_arguments(cls, parser) -> None:
        sub = cls.subparsers(parser)
        for name, h in (("run", "start a study from a YAML study file"),
                        ("resume", "continue a study after the driver stopped or was killed")):
            p = sub.add_parser(name, help=h, description=h)
            p.add_argument("study_file", nargs="?", default=None,
                           help="YAML study file (default: the shipped CPU example)")
            p.add_argument("--policy", help="override the placement policy (one_per_gpu, fixed_fraction, pack, "
                                            "pack_hetero; default: the study file's, pack if it names none)")
            p.add_argument("--run-dir", help="override run_dir (and the default SQLite storage inside it; "
                                             "default: the study file's, hpo-runs/<study> if it names none)")
            p.add_argument("--no-progress", action="store_true", help="no live table (default: a live table on stderr)")
            p.add_argument("--out", help="write the result as JSON to this file (default: none)")
            add_output_arguments(p, ("format",))
            if name == "run":
                p.add_argument("--overwrite", action="store_true",
                               help="delete a stored study of the same name (its trials and checkpoints) and "
                                    "start afresh (default: an existing study is an error naming `resume`)")
        h = "trial counts, best value and running trials of a study"
        p = sub.add_parser("status", help=h, description=h)
        p.add_argument("study_file", nargs="?", help="YAML study file (or give --storage and --study; default: the "
                                                     "shipped CPU example that `hpdl hpo run` runs)")
        p.add_argument("--run-dir", help="the run_dir the study was run with (`run --run-dir`; its SQLite store "
                                         "is read; default: the study file's)")
        p.add_argument("--storage", help="SQLAlchemy URL of the study store (default: the study file's)")
        p.add_argument("--study", help="study name (default: the study file's)")
        add_output_arguments(p, ("format",))
        h = "replay profiled trial costs on a simulated pool (simulation)"
        p = sub.add_parser("simulate", help=h, description=h)
        p.add_argument("--pool", default="12xA100,4xH100",
                       help="simulated pool, e.g. 12xA100,4xH100 or 2xH200 (default: %(default)s)")
        p.add_argument("--trials", help="JSON trace of profiled trials (default: built-in synthetic trace)")
        p.add_argument("--policies", default="one_per_gpu,fixed_fraction,pack,pack_hetero",
                       help="comma-separated policies to replay (default: %(default)s)")
        p.add_argument("--fraction", type=float, default=0.125,
                       help="GPU fraction of fixed_fraction (default: %(default)s)")
        p.add_argument("--plot", metavar="PNG",
                       help="write a PNG of best value against simulated wall time, each line to its makespan "
                            "(default: no plot)")
        p.add_argument("--trials-per-gpu", type=int, default=0,
                       help="replay this many trials per GPU, drawn with replacement (seed 0) from the trace "
                            "(default: 0, the trace as it is)")
        p.add_argument("--mps", action="store_true", help="MPS sharing model (kernels side by side) instead of "
                                                          "time-slicing; pack uses its MPS rule (default: off)")
        p.add_argument("--mps-capacity", type=float, default=4.0,
                       help="summed busy fraction a GPU serves at full speed under MPS (default: %(default)s, fitted "
                            "to the H200 runs)")
        p.add_argument("--overhead", type=float, default=0.0,
                       help="slowdown per extra co-located trial (default: %(default)s; fitted on the H200 runs: 0.05 "
                            "time-sliced, 0.1 MPS)")
        p.add_argument("--startup-s", type=float, default=0.05,
                       help="dispatch of a trial to a warm worker, s (default: %(default)s)")
        p.add_argument("--max-compute", type=float, default=None,
                       help="pack/pack_hetero's summed busy fraction cap (default: the policy's, 2.0 or 8.0 with --mps)")
        p.add_argument("--fuse", type=int, default=16,
                       help="trials per fused model for policies named <policy>+fuse, e.g. pack+fuse (default: "
                            "%(default)s)")
        add_output_arguments(p, ("format",))

    def _spec(self, args):
        from hpdl.hpo.spec import StudySpec
        import yaml

        from hpdl.hpo.errors import HpoConfigError

        path = args.study_file or _example()
        try:
            with open(path) as f:
                d = yaml.safe_load(f) or {}
        except OSError as exc:
            raise HpoConfigError(f"study file {path!r}: {exc.strerror}") from None
        if not isinstance(d, dict):
            raise HpoConfigError(f"study file {path!r}: expected a mapping at the top level")
        if getattr(args, "policy", None):
            d["policy"] = {"name": args.policy}
        if getattr(args, "run_dir", None):
            d["run_dir"], d["storage"] = args.run_dir, ""
        return StudySpec.from_dict(d)

    def _run(self, args, resume: bool = False) -> int:
        # the `hpdl` program itself (not a caller in this process, e.g. a test): it exits as soon as it is done
        program = bool(getattr(args, "_program", False))
        # nothing here imports hpdl.hpo.errors (hence hpdl.runtime, hence torch: seconds) before the handler below
        stop: dict = {"signum": None, "spec": None}

        def line(signum: int, detail: str) -> str:  # the one line every interrupt of `run`/`resume` prints
            return f"hpdl hpo: interrupted by {signal.Signals(signum).name}: {detail}"

        def startup_line() -> str:
            spec, again = stop["spec"], _again(args, stop["spec"])
            if stop.get("done"):  # while the finished study's result was printed
                return line(stop["signum"], f"study {spec.study!r} had finished its budget; nothing to continue "
                                            f"(`hpdl hpo status` shows it)")
            name = f"study {spec.study!r}: " if spec is not None else ""
            return line(stop["signum"], f"{name}stopped during start-up, before any trial started (nothing to "
                                        f"re-queue); `{again}` continues")

        def exit_now() -> None:  # the start-up did not unwind within the deadline (a blocking call)
            print(startup_line(), file=sys.stderr, flush=True)
            os._exit(128 + stop["signum"])

        def startup_signal(signum, _frame):
            if stop.get("exiting"):
                return  # caught already: a second Ctrl-C must not interrupt the exit with a traceback
            if stop["signum"] is None:
                stop["signum"] = signum
                timer = threading.Timer(_EXIT_DEADLINE_S, exit_now)
                timer.daemon = True
                timer.start()
            raise _StartupStop(signum)

        def unraisable(u) -> None:
            # the signal landed in a weakref callback or __del__: Python prints "Exception ignored in ..." and
            # goes on with the start-up (seen once in 3 tries at one moment). Deliver it again, from another
            # thread a moment later: the handler then raises in the main flow, or, once the driver's loop took
            # over, sets its stop flag. (os.kill from here ran the handler inside this hook: swallowed again.)
            if isinstance(u.exc_value, _StartupStop) and not stop.get("exiting"):
                again = threading.Timer(0.01, os.kill, (os.getpid(), u.exc_value.signum))
                again.daemon = True
                again.start()
                return
            previous_hook(u)

        previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable

        # until the driver's loop takes over (it sets a flag instead), a signal stops the start-up at once;
        # installed even where SIGINT was inherited ignored (a background job of a script), as the loop's is.
        # It raises a BaseException: an HpoError (an Exception) raised here was swallowed by an
        # `except Exception` of the start-up (a workload's estimate), and the study ran to its end, exit 0.
        outer = {sig: signal.signal(sig, startup_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            from hpdl.hpo._prestart import process_started_at, start_forkserver

            start_forkserver()  # first: the workers' server imports torch while this process does
            # the counted-in clock: from this process's start when it is the `hpdl` program, else from here
            started = process_started_at() if program else time.time()
            from hpdl.hpo.driver import run_study

            spec = stop["spec"] = self._spec(args)
            res = run_study(spec, resume=resume, progress=not args.no_progress, exit_deadline_s=_EXIT_DEADLINE_S,
                            overwrite=getattr(args, "overwrite", False), started=started)
            stop["done"] = True
            code = self._finished(args, spec, res)
            if program:
                # the study is done and printed: exit now, as the interrupt path does. A Ctrl-C during the
                # interpreter's teardown (seconds with torch loaded) ended the process by the signal, silently
                stop["exiting"] = True
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        except (_StartupStop, Exception) as exc:  # an interrupt: one line, and the shell's status for the signal
            stop["exiting"] = True
            if isinstance(exc, _StartupStop):  # (no import here: hpdl.hpo.errors may not be loaded yet)
                text, code = startup_line(), 128 + exc.signum
            else:
                from hpdl.hpo.errors import HpoInterrupted

                if not isinstance(exc, HpoInterrupted):
                    raise
                text, code = f"hpdl hpo: {exc}", exc.exit_code
                bare = "`hpdl hpo resume` continues"  # the driver does not know this command line; name it here
                if text.endswith(bare):
                    text = text[:-len(bare)] + f"`{_command(args, 'resume')}` continues"
            print(text, file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            # everything is stored, the workers are gone and the lock is released: skip the interpreter's
            # teardown (unloading torch took 3-6 s on a loaded 2-core machine), the user asked to stop now
            os._exit(code)
        finally:
            for sig, h in outer.items():
                signal.signal(sig, h)
            sys.unraisablehook = previous_hook
        return code

    @staticmethod
    def _finished(args, spec, res) -> int:
        """Print (and write) a finished study's result; the exit status."""
        from dataclasses import asdict

        out = asdict(res)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
        if args.format == "json":
            print(json.dumps(out, indent=1))
        else:
            print(f"study {res.study} [{res.policy}]: {res.complete} complete, {res.pruned} pruned, "
                  f"failures {res.failures or 'none'}")
            print(_clocks_line(res))
            if res.requeued:
                print(f"re-queued without spending an attempt: {res.requeued}")
            print(f"best value {res.best_value} with {res.best_params}")
            print(f"storage {spec.storage} (optuna-dashboard {spec.storage})")
        if res.complete == 0:  # the budget is spent and there is no result: a script must see it
            print(f"hpdl hpo: study {res.study!r} ended with no completed configuration "
                  f"(failures {res.failures or 'none'}, {res.pruned} pruned); see `hpdl hpo status`", file=sys.stderr)
            return 1
        return 0

    def _resume(self, args) -> int:
        return self._run(args, resume=True)

    def _status(self, args) -> int:
        from hpdl.hpo.report import study_status

        if args.study_file:
            spec = self._spec(args)
            storage, study = spec.storage, spec.study
        elif args.storage and args.study:
            storage, study = args.storage, args.study
        elif args.run_dir and args.study:  # the default store of a study run with --run-dir
            from pathlib import Path

            storage, study = f"sqlite:///{Path(args.run_dir).resolve() / 'study.db'}", args.study
        elif args.storage or args.study:
            raise CLIUsageError("give both --storage and --study, or a study file")
        else:  # the shipped example, as `hpdl hpo run` without a file
            args.study_file = _example()
            spec = self._spec(args)
            storage, study = spec.storage, spec.study
        from hpdl.hpo.spec import sqlite_path

        if (path := sqlite_path(storage)) is not None and not path.exists():
            from hpdl.hpo.errors import HpoError

            raise HpoError(f"no study store at {storage} (is --storage right, or did the study never start?)")
        s = study_status(storage, study)
        if args.format == "json":
            print(json.dumps(s, indent=1))
            return 0
        print(f"study {s['study']} ({s['direction']}): {s['finished_configs']}/{s['n_trials']} configurations "
              f"finished; states {s['states']}")
        print(f"best value {s['best_value']} with {s['best_params']}" if s["best_params"] is not None
              else "no configuration has completed yet")
        for r in s["running"]:
            print(f"  running trial {r['number']} {_where(r)}")
        for r in s["orphaned"]:
            print(f"  trial {r['number']} was running {_where(r)} when its driver died; `hpdl hpo resume` "
                  "re-queues it (no attempt spent)")
        for r in s["failures"]:
            print(f"  failed trial {r['number']}: {r['reason']}")
        if s["requeued"]:
            print(f"  re-queued without spending an attempt (interrupted, driver died): trials "
                  f"{', '.join(str(r['number']) for r in s['requeued'])}")
        return 0

    def _simulate(self, args) -> int:
        from hpdl.hpo.report import plot_best_vs_time
        from hpdl.hpo.simulator import load_trials, pool_from_spec, resample, simulate, synthetic_trials

        from hpdl.hpo.errors import HpoConfigError

        try:  # a bad value is a usage error naming its flag (`--pool 0xA100` used to spin forever)
            trials = load_trials(args.trials) if args.trials else synthetic_trials()
            pool = pool_from_spec(args.pool)
            if args.trials_per_gpu:
                trials = resample(trials, args.trials_per_gpu * len(pool))
        except HpoConfigError as exc:
            flag = "--trials-per-gpu" if "resample" in str(exc) else "--trials" if "trace" in str(exc) else "--pool"
            raise CLIUsageError(f"{flag}: {exc}") from None
        rows, curves = [], {}
        for name in args.policies.split(","):
            kw = {"fraction": args.fraction} if name == "fixed_fraction" else {}
            if name.startswith("pack") and args.max_compute is not None:
                kw["max_compute"] = args.max_compute
            if name.endswith("+fuse"):  # the policy with trials fused --fuse at a time
                kw["fuse"] = args.fuse
            try:
                r = simulate(trials, pool, name.removesuffix("+fuse"), startup_s=args.startup_s,
                             overhead=args.overhead, mps=args.mps, mps_capacity=args.mps_capacity, **kw)
            except HpoConfigError as exc:
                arg = str(exc).split("=", 1)[0].split(" ")[-1].split(":")[0]
                flag = {"policy": "--policies", "mps_capacity": "--mps-capacity", "startup_s": "--startup-s",
                        "max_compute": "--max-compute", "fraction": "--fraction", "overhead": "--overhead",
                        "trials": "--trials-per-gpu", "fuse": "--fuse"}.get(arg, "--policies")
                raise CLIUsageError(f"{flag}: {exc}") from None
            rows.append({"policy": name, "makespan_s": r.makespan_s, "oom": r.oom, "max_colocated": r.max_colocated})
            curves[name] = r.history
        base = next((r["makespan_s"] for r in rows if r["policy"] == "one_per_gpu"), None)
        for r in rows:
            r["speedup_vs_one_per_gpu"] = base / r["makespan_s"] if base else None
        if args.plot:
            plot_best_vs_time(curves, args.plot, f"SIMULATION: {len(trials)} trials on {args.pool}",
                              ends={r["policy"]: r["makespan_s"] for r in rows})
        if args.format == "json":
            print(json.dumps({"simulation": True, "pool": args.pool, "rows": rows}, indent=1))
            return 0
        print(f"SIMULATION on {args.pool} ({len(trials)} trials, "
              f"{'trace ' + args.trials if args.trials else 'synthetic trace'}, "
              f"{'MPS, capacity ' + str(args.mps_capacity) if args.mps else 'time-sliced'}, overhead {args.overhead})")
        print(f"{'policy':<16}{'makespan s':>12}{'speed-up':>10}{'OOM':>6}{'max/GPU':>9}")
        for r in rows:
            sp = f"{r['speedup_vs_one_per_gpu']:.2f}x" if r["speedup_vs_one_per_gpu"] else "-"
            print(f"{r['policy']:<16}{r['makespan_s']:>12.1f}{sp:>10}{r['oom']:>6}{r['max_colocated']:>9}")
        return 0
