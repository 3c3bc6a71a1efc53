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
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING
from typing import Any, Callable, Iterable, Sequence, TypeVar

T = TypeVar("T")


def option(default: Any = MISSING, *, help: str, type: Callable[[str], Any] | None = None,
           choices: Sequence[Any] | None = None, tristate: bool = False, positional: bool = False,
           required: bool = False) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring).

    Args:
        default: the field's default; none makes the flag required.
        help: the flag's help text (say the default and the unit).
        type: the argparse type (e.g. :func:`hpdl.runtime.limits.count`), which also checks the value.
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
