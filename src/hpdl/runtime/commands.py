"""Loading the command-line groups and plug-ins named by ``"module:Class"`` paths, so that a missing optional
dependency breaks only the command that needs it (with an install hint) instead of the whole ``hpdl`` command."""

from __future__ import annotations

import argparse
import importlib


def attach(parser: argparse.ArgumentParser, path: str, command: str, extra: str | None, missing_key: str,
           cls_key: str) -> None:
    """Import ``path`` (``"module:Class"``) and let its ``add_arguments(parser)`` fill ``parser``; the class goes
    to ``parser``'s defaults under ``cls_key``. When the import needs a module that is not installed, ``parser``
    instead takes any arguments and its ``missing_key`` default says what to install (``pip install
    'hpdl[extra]'``, or reinstall hpdl when no extra provides it), for the command ``command`` to print."""
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        hint = f"pip install 'hpdl[{extra}]'" if extra else "reinstall hpdl"
        parser.set_defaults(**{missing_key: f"{command} needs the module {exc.name!r}: {hint}"})
        parser.add_argument("rest", nargs=argparse.REMAINDER)
        return
    cls.add_arguments(parser)
    parser.set_defaults(**{cls_key: cls})


class CommandGroup:
    """A command group with sub-commands (``hpdl GROUP SUB ...``, argparse sub-parsers), the frame every group
    shares: :meth:`subparsers` declares them (``dest`` names the parsed attribute, ``subcommands`` the names in
    help order) and :meth:`run` calls the method ``_SUB`` of the one parsed (dashes read as underscores).

    Raises (from :meth:`run`):
        CLIUsageError: no sub-command was given, naming the choices.
    """

    dest: str = "cmd"
    subcommands: tuple[str, ...] = ()

    @classmethod
    def subparsers(cls, parser: argparse.ArgumentParser):
        """The sub-parsers action to add each sub-command's parser to."""
        return parser.add_subparsers(dest=cls.dest, metavar="{" + ",".join(cls.subcommands) + "}")

    def run(self, args) -> int:
        from hpdl.runtime.errors import CLIUsageError

        cmd = getattr(args, self.dest, None)
        if cmd is None:
            *first, last = self.subcommands
            raise CLIUsageError(f"choose a sub-command: {', '.join(first)} or {last}" if first
                                else f"choose the sub-command {last}")
        return getattr(self, "_" + cmd.replace("-", "_"))(args)
