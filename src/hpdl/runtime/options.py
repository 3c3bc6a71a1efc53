"""Typed options: a library entry point takes a dataclass, and its command-line flags are generated from it.

A field declared with :func:`option` carries its help text and argparse type; :func:`add_arguments` turns the
fields into ``--flags`` (``batch_size`` -> ``--batch-size``; no default -> required; ``tristate`` ->
``--x/--no-x``; a ``False`` bool -> ``store_true``; ``positional`` -> a positional argument; ``required`` -> a
flag the command line must give although the library has a default, e.g. an output path it may leave None),
and :func:`from_namespace` builds the dataclass from the parsed arguments. So the library never sees an
``argparse.Namespace`` and the CLI never re-declares a field::

    @dataclass(kw_only=True)
    class TrainOptions:
        model: str = option(help="model name")
        lr: float | None = option(None, type=real(0, strict=True), help="peak learning rate (default: the task's)")

    add_arguments(parser, TrainOptions)
    train(from_namespace(TrainOptions, parser.parse_args()))

An options dataclass derives from :class:`Options`, so that a value a Python caller gives is checked as its flag
would be (:func:`check_options`, run before the class's own ``__post_init__``): ``TrainOptions(batch=0)`` raises
:class:`~hpdl.runtime.errors.CLIUsageError` (a ``ValueError``) ``batch (--batch) must be an integer in [1, 65536],
got 0``, not a failure deep inside the run. A field's ``type`` is called on the typed value (the checkers of
:mod:`hpdl.runtime.limits` accept both the flag's string and a number); where it declares a ``value_type`` (int
or float), a ``str`` from Python is refused rather than parsed: only the command line parses strings.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import MISSING
from typing import Any, Callable, Iterable, Sequence, TypeVar

from hpdl.runtime.errors import CLIUsageError

T = TypeVar("T")


def option(default: Any = MISSING, *, help: str, type: Callable[[str], Any] | None = None,
           choices: Sequence[Any] | None = None, tristate: bool = False, positional: bool = False,
           required: bool = False) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring).

    Args:
        default: the field's default; none makes the flag required.
        help: the flag's help text (say the default and the unit).
        type: the argparse type (e.g. :func:`hpdl.runtime.limits.count`), which also checks the value; it must
            accept the typed value too (:func:`check_options` calls it on what a Python caller gave).
        choices: the values the flag accepts.
        tristate: a ``bool | None`` field set by ``--x`` / ``--no-x`` and left None otherwise.
        positional: a positional argument (``trace``) rather than a flag; required unless it has a default.
        required: the flag must be given on the command line even though the field has a default (which
            library callers keep).

    Raises:
        ValueError: ``tristate`` with ``type``/``choices``, or ``positional`` with ``tristate``/``required``.
    """
    if tristate and (type is not None or choices is not None):
        raise ValueError("option(tristate=True) takes no type or choices: it is set by --x / --no-x")
    if positional and (tristate or required):
        raise ValueError("option(positional=True) cannot be tristate or required (a positional without a "
                         "default is required)")
    return dataclasses.field(default=default, metadata={"help": help, "type": type, "choices": choices,
                                                        "tristate": tristate, "positional": positional,
                                                        "required": required})


def add_arguments(parser, cls: type, exclude: Iterable[type] = ()) -> None:
    """Add a flag for every :func:`option` field of dataclass ``cls`` to ``parser`` (a parser or an argument
    group), in declaration order, leaving out the fields of the dataclasses in ``exclude``."""
    skip = {f.name for base in exclude for f in dataclasses.fields(base)}
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        meta, kw = f.metadata, {"help": f.metadata["help"]}
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        if has_default:
            kw["default"] = f.default if f.default is not MISSING else f.default_factory()
        if meta.get("positional"):
            if has_default:
                kw["nargs"] = "?"
        elif not has_default or meta.get("required"):
            kw["required"] = True
        if meta["tristate"]:
            kw["action"] = argparse.BooleanOptionalAction
        elif f.default is False and meta["type"] is None:
            kw["action"] = "store_true"
        else:
            if meta["type"] is not None:
                kw["type"] = meta["type"]
            if meta["choices"] is not None:
                kw["choices"] = list(meta["choices"])
        if meta.get("positional"):
            parser.add_argument(f.name, **kw)
        else:
            parser.add_argument("--" + f.name.replace("_", "-"), **kw)


def from_namespace(cls: type[T], args: argparse.Namespace) -> T:
    """``cls`` built from the parsed arguments of :func:`add_arguments` (fields the namespace lacks keep their
    defaults)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def _label(f: dataclasses.Field) -> str:
    if f.metadata.get("positional"):
        return f.name
    return f"{f.name} (--{f.name.replace('_', '-')})"


def _checked(f: dataclasses.Field, value: Any) -> Any:
    """``value`` of option field ``f`` checked (and converted, e.g. an int for a float field to a float) as the
    command line would; raises :class:`CLIUsageError` naming the field and its flag."""
    meta = f.metadata
    checker, choices = meta.get("type"), meta.get("choices")
    is_bool = meta.get("tristate") or (f.default is False and checker is None)
    if value is None:
        if f.default is None or not (checker is not None or choices is not None or is_bool):
            return None   # None is the field's default (or a plain text field: nothing to check)
        raise CLIUsageError(f"{_label(f)} must be given a value, got None")
    if is_bool:
        if not isinstance(value, bool):
            raise CLIUsageError(f"{_label(f)} must be True or False, got {value!r}")
        return value
    if checker is not None:
        value_type = getattr(checker, "value_type", checker if checker in (int, float) else None)
        if value_type is not None and isinstance(value, str):
            what = "an integer" if value_type is int else "a number"
            raise CLIUsageError(f"{_label(f)} must be {what}, got the str {value!r} (only the command line "
                                "parses strings)")
        try:
            value = checker(value)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise CLIUsageError(f"{_label(f)} {exc}") from None
    if choices is not None and value not in choices:
        raise CLIUsageError(f"{_label(f)} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_options(obj: Any) -> None:
    """Check every :func:`option` field of dataclass instance ``obj`` as its flag is checked: its ``type`` checker
    (range, and a number rather than a str), its ``choices``, a bool for a ``tristate`` or ``store_true`` field.
    ``None`` passes where it is the field's default. A checker's converted value is stored back (an int given
    for a float field becomes a float), through ``object.__setattr__`` so frozen dataclasses work too.

    Raises:
        CLIUsageError: (a ``ValueError``) the first bad field, named with its flag, the expected value and what
            was given.
    """
    for f in dataclasses.fields(obj):
        if "help" not in f.metadata:
            continue
        value = getattr(obj, f.name)
        new = _checked(f, value)
        if new is not value:
            object.__setattr__(obj, f.name, new)


class Options:
    """Base of an options dataclass: its instances are checked by :func:`check_options` when built.

    ``__post_init__`` runs the check; a subclass that defines its own ``__post_init__`` (cross-field checks) gets
    the check run before it, whether or not it calls ``super().__post_init__()``.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is not None and not getattr(own, "_checks_options", False):
            @functools.wraps(own)
            def __post_init__(self, *args, **kw):
                check_options(self)
                own(self, *args, **kw)

            __post_init__._checks_options = True
            cls.__post_init__ = __post_init__

    def __post_init__(self):
        check_options(self)
