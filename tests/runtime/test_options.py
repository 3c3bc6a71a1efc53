"""hpdl.runtime.options: a dataclass's fields become flags, and parsed flags become the dataclass."""

import argparse
from dataclasses import dataclass

import pytest

from hpdl.runtime.limits import count
from hpdl.runtime.options import add_arguments, from_namespace, option


@dataclass(kw_only=True)
class Base:
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
class Place:
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
