"""``hpdl vision``: train and evaluate vision models, and make the offline datasets they default to.

    hpdl vision train --model soft_tiny [--data DIR] ...     # classification (ImageFolder)
    hpdl vision train --model sprnet [--data DIR] ...        # instance segmentation (COCO format)
    hpdl vision evaluate --model NAME --checkpoint CKPT [--data DIR]

A model name belongs to one task module (``hpdl.vision.classify`` or ``hpdl.vision.detect``); each module
exposes ``MODELS`` (the names it trains), ``TrainOptions`` / ``EvaluateOptions`` (typed dataclasses extending
:mod:`hpdl.vision.options`, from which the flags are generated), ``train(options)``, ``evaluate(options)`` and
``COMMANDS`` (extra sub-commands: name -> (help, options dataclass, run(options))). The options every task shares are
declared once, in :mod:`hpdl.vision.options`; a task fills in its own defaults where they are left as None.
"""

from __future__ import annotations

import importlib

from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.options import add_arguments, from_namespace
from hpdl.vision.options import EvaluateRun, TrainRun

TASK_MODULES = ("hpdl.vision.classify", "hpdl.vision.detect")


def _modules():
    mods = []
    for name in TASK_MODULES:
        try:
            mods.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:  # a task whose module is not written yet, or lacks its extra
            if exc.name == name:
                continue
            raise
    return mods


class VisionCommand:
    """CLI group ``vision`` (see module docstring)."""

    @staticmethod
    def add_arguments(parser) -> None:
        mods = _modules()
        sub = parser.add_subparsers(dest="vision_cmd", metavar="{train,evaluate,...}")
        for cmd, evaluate in (("train", False), ("evaluate", True)):
            p = sub.add_parser(cmd, help=f"{cmd} a model ({', '.join(m for mod in mods for m in mod.MODELS)})")
            shared = EvaluateRun if evaluate else TrainRun
            add_arguments(p, shared)
            for mod in mods:
                add_arguments(p.add_argument_group(mod.__name__.rsplit(".", 1)[-1]),
                              mod.EvaluateOptions if evaluate else mod.TrainOptions, exclude=(shared,))
        for mod in mods:
            for name, (text, cls, _run) in mod.COMMANDS.items():
                add_arguments(sub.add_parser(name, help=text, description=text), cls)

    def run(self, args) -> int:
        cmd = getattr(args, "vision_cmd", None)
        if cmd is None:
            raise CLIUsageError("give a sub-command: train, evaluate, or one of the dataset commands")
        mods = _modules()
        if cmd in ("train", "evaluate"):
            for mod in mods:
                if args.model in mod.MODELS:
                    options = from_namespace(mod.EvaluateOptions if cmd == "evaluate" else mod.TrainOptions, args)
                    return int(getattr(mod, cmd)(options) or 0)
            known = sorted(m for mod in mods for m in mod.MODELS)
            raise CLIUsageError(f"--model {args.model!r} is not a vision model; expected one of {known}")
        for mod in mods:
            if cmd in mod.COMMANDS:
                _text, cls, run = mod.COMMANDS[cmd]
                return int(run(from_namespace(cls, args)) or 0)
        raise CLIUsageError(f"unknown vision command {cmd!r}")
