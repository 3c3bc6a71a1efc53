"""The options every vision task shares, as typed dataclasses (``hpdl vision train/evaluate`` generates its
flags from them; a task module extends them with its own fields: ``classify.TrainOptions``,
``detect.TrainOptions``, ...). A field left None takes the task's default."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from hpdl.runtime.limits import count, real
from hpdl.runtime.options import Options, option


def device_name(text: str) -> str:
    """Checker of ``--device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (an argparse type and the check of a
    Python caller's value); raises ``argparse.ArgumentTypeError`` otherwise."""
    if not isinstance(text, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r}")
    return text


@dataclass(kw_only=True)
class RunOptions(Options):
    """What ``train`` and ``evaluate`` of every task take."""

    model: str = option(help="model name, e.g. soft_tiny or sprnet")
    data: str | None = option(None, help="dataset folder (default: the task's offline set, made if absent)")
    device: str = option("auto", type=device_name, help="cpu, cuda or auto (cuda when available) (default: auto)")
    batch_size: int | None = option(None, type=count(1, 1 << 16), help="images per step (default: the task's)")
    workers: int = option(2, type=count(0, 256), help="data-loader worker processes (default: 2)")
    image_size: int | None = option(None, type=count(1, 8192), help="input side in pixels (default: the task's)")
    amp: bool | None = option(None, tristate=True,
                              help="mixed precision (bf16 on CUDA; default: on for CUDA, off for CPU)")
    seed: int = option(0, type=count(0, 2**32 - 1), help="random seed, >= 0 (default: 0)")


@dataclass(kw_only=True)
class EvaluateRun(RunOptions):
    """``hpdl vision evaluate``: a trained checkpoint on the validation split."""

    checkpoint: str = option(help="checkpoint written by `hpdl vision train`")


@dataclass(kw_only=True)
class TrainRun(RunOptions):
    """``hpdl vision train``: the schedule shared by the tasks (None: the task's default)."""

    epochs: int | None = option(None, type=count(1, 100_000),
                                help="passes over the training set (default: the task's)")
    max_steps: int | None = option(None, type=count(1), help="stop after this many steps (default: no limit)")
    lr: float | None = option(None, type=real(0, 10, strict=True), help="peak learning rate (default: the task's)")
    weight_decay: float | None = option(None, type=real(0, 10), help="weight decay (default: the task's)")
    warmup_epochs: float | None = option(None, type=real(0, 100_000), help="linear warm-up (default: the task's)")
    clip_grad: float | None = option(None, type=real(0, 1e6), help="gradient-norm clip, 0: off (default: the task's)")
    out: str = option("vision_out", help="folder for checkpoints and logs (default: ./vision_out)")
