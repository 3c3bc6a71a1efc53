"""The ``hpdl`` command: one sub-command group per subsystem; each group parses, calls its API and prints.

A group is a class with ``name``, ``help``, ``add_arguments(parser)`` and ``run(args) -> int``, registered
in ``GROUPS`` by import path so that a group's heavy imports happen only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from hpdl import __version__

# name -> "module:Class"; the class is imported lazily.
GROUPS: dict[str, str] = {
    "bench": "hpdl.bench.cli:BenchCommand",
    "hpo": "hpdl.hpo.cli:HpoCommand",
}


class CLIUsageError(ValueError):
    """Bad command-line usage: prints the sub-command's help and exits 1."""


def _load(path: str):
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpdl", description="hpdl: fast collectives, scheduling and serving "
                                     "for deep learning and HPC jobs on GPU clusters.")
    parser.add_argument("--version", action="version", version=f"hpdl {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="group", metavar="{" + ",".join(GROUPS) + "}")
    for name, path in GROUPS.items():
        cls = _load(path)
        p = sub.add_parser(name, help=cls.help, description=cls.help)
        cls.add_arguments(p)
        p.set_defaults(_cls=cls, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.group is None:
        parser.print_help()
        return 1
    try:
        return int(args._cls().run(args) or 0)
    except CLIUsageError as exc:
        args._parser.print_help(sys.stderr)
        print(f"\nhpdl {args.group}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's job is to report, --debug shows the traceback
        if args.debug:
            raise
        print(f"hpdl {args.group}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
