"""``hpdl vision``: train and evaluate vision models, and make the offline datasets they default to.

    hpdl vision train --model soft_tiny [--data DIR] ...     # classification (ImageFolder)
    hpdl vision train --model sprnet [--data DIR] ...        # instance segmentation (COCO format)
    hpdl vision evaluate --model NAME --checkpoint CKPT [--data DIR]

A model name belongs to one task module (``hpdl.vision.classify`` or ``hpdl.vision.detect``); each module
exposes ``MODELS`` (the names it trains), ``add_arguments(group)`` (its own options), ``train(args)``,
``evaluate(args)`` and ``COMMANDS`` (extra sub-commands: name -> (help, add_arguments, run)). The options that
every task shares are declared once here; a task fills in its own defaults where they are left as None.
"""

from __future__ import annotations

import importlib
import math

from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.limits import MAX_COUNT, count, real

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


def _count(minimum: int, maximum: int = MAX_COUNT):
    """argparse type: an int in [minimum, maximum] (0 or a negative used to fall back to the task's default
    silently, through ``args.x or default``, or fail deep inside the model; a huge one to run for ever)."""
    return count(minimum, maximum)


def _real(minimum: float, strict: bool = False, maximum: float = math.inf):
    """argparse type: a finite float >= minimum (> minimum when ``strict``), <= maximum. A negative clip used to
    switch clipping off and a negative warm-up to mean none, silently; a NaN learning rate failed after data
    loading."""
    return real(minimum, maximum, strict=strict)


def _common(p, evaluate: bool) -> None:
    p.add_argument("--model", required=True, help="model name, e.g. soft_tiny or sprnet")
    p.add_argument("--data", default=None, help="dataset folder (default: the task's offline set, made if absent)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available) (default: auto)")
    p.add_argument("--batch-size", type=_count(1, 1 << 16), default=None, help="images per step (default: the task's)")
    p.add_argument("--workers", type=_count(0, 256), default=2, help="data-loader worker processes (default: 2)")
    p.add_argument("--image-size", type=_count(1, 8192), default=None, help="input side in pixels (default: the task's)")
    p.add_argument("--amp", action=__import__("argparse").BooleanOptionalAction, default=None,
                   help="mixed precision (bf16 on CUDA; default: on for CUDA, off for CPU)")
    p.add_argument("--seed", type=_count(0, 2**32 - 1), default=0, help="random seed, >= 0 (default: 0)")
    if evaluate:
        p.add_argument("--checkpoint", required=True, help="checkpoint written by `hpdl vision train`")
    else:
        p.add_argument("--epochs", type=_count(1, 100_000), default=None, help="passes over the training set (default: the task's)")
        p.add_argument("--max-steps", type=_count(1), default=None, help="stop after this many steps (default: no limit)")
        p.add_argument("--lr", type=_real(0, strict=True, maximum=10), default=None, help="peak learning rate (default: the task's)")
        p.add_argument("--weight-decay", type=_real(0, maximum=10), default=None, help="weight decay (default: the task's)")
        p.add_argument("--warmup-epochs", type=_real(0, maximum=100_000), default=None, help="linear warm-up (default: the task's)")
        p.add_argument("--clip-grad", type=_real(0, maximum=1e6), default=None, help="gradient-norm clip, 0: off (default: the task's)")
        p.add_argument("--out", default="vision_out", help="folder for checkpoints and logs (default: ./vision_out)")


class VisionCommand:
    """CLI group ``vision`` (see module docstring)."""

    @staticmethod
    def add_arguments(parser) -> None:
        mods = _modules()
        sub = parser.add_subparsers(dest="vision_cmd", metavar="{train,evaluate,...}")
        for cmd, evaluate in (("train", False), ("evaluate", True)):
            p = sub.add_parser(cmd, help=f"{cmd} a model ({', '.join(m for mod in mods for m in mod.MODELS)})")
            _common(p, evaluate)
            for mod in mods:
                mod.add_arguments(p.add_argument_group(mod.__name__.rsplit(".", 1)[-1]), evaluate=evaluate)
        for mod in mods:
            for name, (text, add, _run) in mod.COMMANDS.items():
                add(sub.add_parser(name, help=text, description=text))

    def run(self, args) -> int:
        cmd = getattr(args, "vision_cmd", None)
        if cmd is None:
            raise CLIUsageError("give a sub-command: train, evaluate, or one of the dataset commands")
        mods = _modules()
        if cmd in ("train", "evaluate"):
            for mod in mods:
                if args.model in mod.MODELS:
                    return int(getattr(mod, cmd)(args) or 0)
            known = sorted(m for mod in mods for m in mod.MODELS)
            raise CLIUsageError(f"--model {args.model!r} is not a vision model; expected one of {known}")
        for mod in mods:
            if cmd in mod.COMMANDS:
                return int(mod.COMMANDS[cmd][2](args) or 0)
        raise CLIUsageError(f"unknown vision command {cmd!r}")
