"""hpdl.runtime.options: a dataclass's fields become flags, and parsed flags become the dataclass."""

import argparse
from dataclasses import dataclass

import pytest

from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.limits import count, real
from hpdl.runtime.options import Options, add_arguments, check_options, from_namespace, option


@dataclass(kw_only=True)
class Base(Options):
    model: str = option(help="model name")
    batch_size: int | None = option(None, type=count(1, 64), help="rows per step")
    amp: bool | None = option(None, tristate=True, help="mixed precision")
    verbose: bool = option(False, help="say more")


@dataclass(kw_only=True)
class Task(Base):
    mode: str = option("a", choices=("a", "b"), help="which")
    internal: int = 3   # not an option: no flag


def parse(cls, argv, exclude=()):
    p = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(p, cls, exclude=exclude)
    return p, p.parse_args(argv)


def test_fields_become_flags_and_back():
    _, ns = parse(Task, ["--model", "m", "--batch-size", "8", "--no-amp", "--verbose", "--mode", "b"])
    t = from_namespace(Task, ns)
    assert t == Task(model="m", batch_size=8, amp=False, verbose=True, mode="b")
    _, ns = parse(Task, ["--model", "m"])
    assert from_namespace(Task, ns) == Task(model="m")   # defaults: None, None, False, "a"
    assert not hasattr(ns, "internal")


def test_bad_values_are_usage_errors_naming_the_flag():
    p = argparse.ArgumentParser(prog="x")
    add_arguments(p, Task)
    with pytest.raises(SystemExit):
        p.parse_args([])   # --model is required
    for argv in (["--model", "m", "--batch-size", "0"], ["--model", "m", "--mode", "c"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)


def test_exclude_leaves_the_shared_fields_to_another_parser():
    p, _ = parse(Task, ["--mode", "a"], exclude=(Base,))
    flags = {a.dest for a in p._actions} - {"help"}
    assert flags == {"mode"}


@dataclass(kw_only=True)
class Place(Options):
    trace: str = option(help="input file", positional=True)
    plot: str = option("p.png", positional=True, help="optional positional")
    out: str | None = option(None, required=True, help="output (the library may leave it None)")


def test_positional_and_required_flags():
    p = argparse.ArgumentParser(prog="x")
    add_arguments(p, Place)
    ns = p.parse_args(["t.npz", "--out", "o.json"])
    assert from_namespace(Place, ns) == Place(trace="t.npz", out="o.json")   # the optional positional's default
    assert from_namespace(Place, p.parse_args(["t.npz", "q.png", "--out", "o"])).plot == "q.png"
    assert Place(trace="t").out is None   # a library caller keeps the default
    for argv in ([], ["t.npz"]):          # the positional, then --out, are required on the command line
        with pytest.raises(SystemExit):
            p.parse_args(argv)


def test_bad_option_declarations_are_refused():
    with pytest.raises(ValueError, match="tristate"):
        option(None, tristate=True, type=int, help="x")
    with pytest.raises(ValueError, match="positional"):
        option(positional=True, required=True, help="x")


@dataclass(kw_only=True)
class Checked(Options):
    steps: int = option(10, type=count(0, 100), help="steps")
    lr: float = option(0.1, type=real(0, 1, strict=True), help="rate")
    limit: float | None = option(None, type=real(0), help="optional")
    mode: str = option("a", choices=("a", "b"), help="which")
    fast: bool = option(False, help="flag")
    calls: int = 0   # not an option: not checked

    def __post_init__(self):   # a cross-field check: runs after the per-field checks (it sees typed values)
        if self.steps and self.mode == "b":
            raise CLIUsageError("mode b takes no steps")


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": -1}, r"steps \(--steps\) must be an integer in \[0, 100\], got -1"),
    ({"steps": 101}, r"steps \(--steps\) must be an integer in \[0, 100\], got 101"),
    ({"steps": "5"}, r"steps \(--steps\) must be an integer, got the str '5'"),
    ({"steps": 2.5}, r"steps \(--steps\) must be an integer, got 2.5 \(float\)"),
    ({"steps": True}, r"steps \(--steps\) must be an integer, got True \(bool\)"),
    ({"steps": None}, r"steps \(--steps\) must be given a value, got None"),
    ({"lr": 0}, r"lr \(--lr\) must be a finite number > 0 and <= 1, got 0"),
    ({"lr": float("nan")}, r"lr \(--lr\) must be a finite number"),
    ({"lr": "0.1"}, r"lr \(--lr\) must be a number, got the str '0.1'"),
    ({"limit": -1.0}, r"limit \(--limit\) must be a finite number >= 0"),
    ({"mode": "c"}, r"mode \(--mode\) must be one of 'a', 'b', got 'c'"),
    ({"fast": 1}, r"fast \(--fast\) must be True or False, got 1"),
])
def test_python_values_are_checked_as_their_flags(kwargs, message):
    with pytest.raises(CLIUsageError, match=message):
        Checked(**kwargs)


def test_checked_values_are_converted_and_the_defaults_pass():
    import numpy as np

    c = Checked(steps=np.int64(3), lr=1, limit=2, fast=True)
    assert (c.steps, c.lr, c.limit) == (3, 1.0, 2.0)
    assert type(c.steps) is int and type(c.lr) is float and type(c.limit) is float
    assert Checked() == Checked(steps=10, lr=0.1, limit=None, mode="a", fast=False)
    Checked(calls=-5)   # a plain field is not an option: no check
    with pytest.raises(CLIUsageError, match="mode b takes no steps"):   # the class's own check still runs
        Checked(mode="b")
    with pytest.raises(CLIUsageError, match="steps"):   # ... after the field checks
        Checked(mode="b", steps=-1)


def test_a_subclass_and_a_frozen_dataclass_are_checked():
    @dataclass(kw_only=True)
    class More(Checked):
        extra: int = option(1, type=count(1), help="x")

    @dataclass(kw_only=True, frozen=True)
    class Frozen(Options):
        lr: float = option(0.5, type=real(0), help="rate")

    with pytest.raises(CLIUsageError, match=r"extra \(--extra\)"):
        More(extra=0)
    with pytest.raises(CLIUsageError, match=r"steps \(--steps\)"):
        More(steps=-1)
    assert type(Frozen(lr=1).lr) is float
    with pytest.raises(ValueError, match="lr"):
        Frozen(lr=-1)


def test_check_options_of_a_parsed_namespace_agrees_with_argparse():
    _, ns = parse(Checked, ["--steps", "7", "--lr", "0.5", "--mode", "a", "--fast"])
    c = from_namespace(Checked, ns)
    assert (c.steps, c.lr, c.fast) == (7, 0.5, True)
    check_options(c)   # idempotent
    c.steps = -2       # a later assignment is caught by an explicit check
    with pytest.raises(CLIUsageError, match="steps"):
        check_options(c)


def test_checkers_take_strings_and_typed_values():
    import argparse as ap

    assert count(1, 9)("3") == 3 and count(1, 9)(3) == 3
    assert real(0)("2.5") == 2.5 and real(0)(2) == 2.0
    for bad in (True, 2.0, None):
        with pytest.raises(ap.ArgumentTypeError, match="must be an integer"):
            count()(bad)
    with pytest.raises(ap.ArgumentTypeError, match="must be a number"):
        real()(False)
