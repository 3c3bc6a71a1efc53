"""The ``hpdl`` command: one sub-command group per subsystem; each group parses, calls its API and prints.

A group is a class with ``add_arguments(parser)`` and ``run(args) -> int``, registered in ``GROUPS`` by import
path so that a group's imports (and optional dependencies) are needed only when that group runs.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hpdl import __version__
from hpdl.runtime.commands import attach
from hpdl.runtime.errors import CLIUsageError

__all__ = ["CLIUsageError", "GROUPS", "build_parser", "main"]

# name -> ("module:Class", one-line help, the extra that installs its dependencies). Only the group being run
# is imported, so a missing optional dependency breaks that group alone, with an install hint.
GROUPS: dict[str, tuple[str, str, str | None]] = {
    "bench": ("hpdl.bench.cli:BenchCommand",
              "every benchmark, on one harness: collectives (nccl-tests columns, exact #wrong, speed-up over "
              "native), the cost model, and each subsystem's (serve, moe, apps, jacobi, overlap, attention)", None),
    "tes": ("hpdl.tes.cli:TesCommand",
            "HD-TES stimulator SoC model: simulate protocols, check safety, reproduce the chip spec", "tes"),
    "serve": ("hpdl.serve.cli:ServeCommand",
              "OpenAI-compatible LLM server with Flover temporal fusion; `hpdl serve bench` benchmarks it", "serve"),
    "hpo": ("hpdl.hpo.cli:HpoCommand",
            "resource-aware HPO (HyperSack): Optuna studies packed onto GPUs, elastic and fault tolerant", "hpo"),
    "vision": ("hpdl.vision.cli:VisionCommand",
               "vision models (SOFT, SPRNet): train, evaluate, make offline datasets", "vision"),
    "offload": ("hpdl.offload.cli:OffloadCommand",
                "offload communication plans to a progress agent: run the agent, the Jacobi comparison",
                None),
    "moe": ("hpdl.moe.cli:MoECommand",
            "ExFlow MoE inference: routing traces, expert affinity, ILP placement, 1-Alltoall engine, bench", None),
}




def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``hpdl`` parser; with ``only``, just that group's arguments are loaded (the others list their help)."""
    parser = argparse.ArgumentParser(prog="hpdl", description="hpdl: fast collectives, scheduling and serving "
                                     "for deep learning and HPC jobs on GPU clusters.")
    parser.add_argument("--version", action="version", version=f"hpdl {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="group", metavar="{" + ",".join(GROUPS) + "}")
    for name, (path, text, extra) in GROUPS.items():
        p = sub.add_parser(name, help=text, description=text)
        p.set_defaults(_parser=p)
        if only not in (None, name):
            continue
        attach(p, path, f"hpdl {name}", extra, "_missing", "_cls")
    return parser


def _group_of(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    program = argv is None  # the command line itself: a group may exit at once when done (hpo run)
    argv = sys.argv[1:] if argv is None else list(argv)
    group = _group_of(argv)
    try:
        return _main(argv, group, program)
    except KeyboardInterrupt:  # Ctrl-C anywhere a group does not handle it itself: one line, no traceback
        name = f"hpdl {group}" if group in GROUPS else "hpdl"
        print(f"{name}: interrupted by SIGINT", file=sys.stderr)
        return 130


def _subcommand_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the subcommand named in ``argv`` (e.g. ``hpdl hpo simulate``), else ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for tok in argv:
                if tok in action.choices:
                    return action.choices[tok]
    return parser


def _main(argv: list[str], group: str | None, program: bool = False) -> int:
    parser = build_parser(group if group in GROUPS else None)
    args = parser.parse_args(argv)
    args._program = program
    args._command = " ".join(["hpdl", *argv])   # as typed; what benchmark results record (meta["command"])
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.group is None:
        parser.print_help()
        return 1
    if getattr(args, "_missing", None):
        print(args._missing, file=sys.stderr)
        return 1
    try:
        return int(args._cls().run(args) or 0)
    except CLIUsageError as exc:
        sub = _subcommand_parser(args._parser, argv)  # `hpdl hpo simulate`'s usage, not `hpdl hpo`'s
        sub.print_usage(sys.stderr)
        print(f"{sub.prog}: error: {exc} (see {sub.prog} --help)", file=sys.stderr)
        return exc.exit_status
    except ModuleNotFoundError as exc:  # an optional dependency imported late, inside the command
        if args.debug:
            raise
        extra = GROUPS[args.group][2]
        hint = f"pip install 'hpdl[{extra}]'" if extra else f"pip install {exc.name}"
        print(f"hpdl {args.group} needs the module {exc.name!r}: {hint}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the CLI's job is to report, --debug shows the traceback
        if args.debug:
            raise
        print(f"hpdl {args.group}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # `python -m hpdl.cli`: run the imported module, so its CLIUsageError is the one raised
    from hpdl.cli import main as _main

    sys.exit(_main())
