"""hpdl.runtime.commands.CommandGroup: the frame every ``hpdl GROUP SUB`` command shares (hpo, tes, offload)."""

import argparse

import pytest

from hpdl.runtime.commands import CommandGroup
from hpdl.runtime.errors import CLIUsageError


class _Group(CommandGroup):
    dest, subcommands = "demo_cmd", ("make-it", "show")

    @classmethod
    def add_arguments(cls, parser):
        sub = cls.subparsers(parser)
        sub.add_parser("make-it").add_argument("--n", type=int, default=1)
        sub.add_parser("show")

    def _make_it(self, args):
        return 10 + args.n

    def _show(self, args):
        return 3


def _parse(argv):
    p = argparse.ArgumentParser()
    _Group.add_arguments(p)
    return p, p.parse_args(argv)


def test_runs_the_parsed_subcommands_method():
    assert _Group().run(_parse(["make-it", "--n", "2"])[1]) == 12   # the dash read as an underscore
    assert _Group().run(_parse(["show"])[1]) == 3


def test_no_subcommand_is_a_usage_error_naming_the_choices():
    p, args = _parse([])
    assert "{make-it,show}" in p.format_usage()
    with pytest.raises(CLIUsageError, match="choose a sub-command: make-it or show"):
        _Group().run(args)


@pytest.mark.parametrize("group", ["hpo", "tes", "offload"])
def test_hpdl_groups_refuse_a_missing_subcommand(group, capsys):
    from hpdl.cli import main

    assert main([group]) == 1
    assert f"hpdl {group}: error: choose a sub-command:" in capsys.readouterr().err
