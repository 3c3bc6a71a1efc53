"""Workloads and helpers for the fault tests (importable by spawned workers: this folder is on sys.path)."""

import os
import signal
import subprocess
import sys

from hpdl.hpo.workloads import VisionCNN


def start_driver(spec_expr: str, **env: str) -> subprocess.Popen:
    """A driver process running ``run_study(<spec_expr>)`` (a Python expression building the StudySpec),
    with one intra-op thread, this folder importable, and ``env`` added to the environment."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", **env,
            "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__))] + sys.path)}
    code = f"from hpdl.hpo.driver import run_study; from hpdl.hpo.spec import StudySpec; run_study({spec_expr})"
    return subprocess.Popen([sys.executable, "-c", code], env=full)


class CrashOnceCNN(VisionCNN):
    """The small CNN whose process kills itself (SIGKILL) at step ``crash_at`` of the first attempt of
    the configuration with ``width == crash_width``; a marker file in ``crash_dir`` records the crash."""

    name = "crash_once_cnn"
    defaults = {**VisionCNN.defaults, "crash_dir": "", "crash_at": 25, "crash_width": 8}

    def train(self, ctx):
        marker = os.path.join(ctx.params["crash_dir"], f"crashed-{ctx.lineage}")
        if int(ctx.params["width"]) == int(ctx.params["crash_width"]) and not os.path.exists(marker):
            inner = ctx.step

            def step(s):
                if s == int(ctx.params["crash_at"]):
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                return inner(s)

            ctx.step = step
        return super().train(ctx)


class RaiseOnceCNN(VisionCNN):
    """The small CNN whose first attempt of every configuration raises ``ValueError`` before training
    (a marker file in ``crash_dir`` per lineage): the trial fails with ``error`` and its worker exits."""

    name = "raise_once_cnn"
    defaults = {**VisionCNN.defaults, "crash_dir": ""}

    def train(self, ctx):
        marker = os.path.join(ctx.params["crash_dir"], f"raised-{ctx.lineage}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            raise ValueError("first attempt fails on purpose")
        return super().train(ctx)


class EnvRecordingCNN(VisionCNN):
    """The small CNN that writes the value of environment variable ``env_var`` (default
    ``CUDA_MPS_PIPE_DIRECTORY``) its worker process saw into ``crash_dir/env-<lineage>`` (checks that
    ``mps: start`` and the driver's environment reach the workers)."""

    name = "env_recording_cnn"
    defaults = {**VisionCNN.defaults, "crash_dir": "", "env_var": "CUDA_MPS_PIPE_DIRECTORY"}

    def train(self, ctx):
        with open(os.path.join(ctx.params["crash_dir"], f"env-{ctx.lineage}"), "w") as f:
            f.write(os.environ.get(ctx.params["env_var"], ""))
        return super().train(ctx)


class BlockingCNN(VisionCNN):
    """A trial that writes its pid to ``crash_dir/pid-<lineage>`` and then blocks for ``block_s`` seconds
    without reaching a training step (a long step, evaluation or data load): only a watchdog, not the
    per-step parent check, can end it when the driver dies."""

    name = "blocking_cnn"
    defaults = {**VisionCNN.defaults, "crash_dir": "", "block_s": 120.0}

    def train(self, ctx):
        import time

        path = os.path.join(ctx.params["crash_dir"], f"pid-{ctx.lineage}")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        time.sleep(float(ctx.params["block_s"]))
        return super().train(ctx)


class NanCNN(VisionCNN):
    """The small CNN whose objective is NaN (a diverged run) for ``width == nan_width``."""

    name = "nan_cnn"
    defaults = {**VisionCNN.defaults, "nan_width": 4}

    def train(self, ctx):
        value = super().train(ctx)
        return float("nan") if int(ctx.params["width"]) == int(ctx.params["nan_width"]) else value


def start_cli(*argv: str, out=subprocess.PIPE, **env: str) -> subprocess.Popen:
    """``hpdl <argv>`` in a new process (one intra-op thread, this folder importable); stdout and stderr go
    to ``out`` (a pipe by default, or an open file)."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", **env,
            "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__))] + sys.path)}
    return subprocess.Popen([sys.executable, "-m", "hpdl.cli", *argv], env=full, stderr=out,
                            stdout=out, text=True)


class SlowCNN(VisionCNN):
    """The small CNN with ``sleep_s`` of sleep in every step: a trial stays busy (and checkpointed at each
    evaluation) long enough to be interrupted, without using the CI machine's two cores."""

    name = "slow_cnn"
    defaults = {**VisionCNN.defaults, "sleep_s": 0.05}

    def train(self, ctx):
        import time

        inner = ctx.step

        def step(s):
            time.sleep(float(ctx.params["sleep_s"]))
            return inner(s)

        ctx.step = step
        return super().train(ctx)


class AlwaysRaiseCNN(VisionCNN):
    """Every attempt raises before training: a study in which every configuration fails."""

    name = "always_raise_cnn"

    def train(self, ctx):
        raise ValueError("this configuration always fails")


def quadratic(trial):
    """A plain Optuna objective (define-by-run) for ``hpdl.hpo.optimize``: minimum 0 at x = 1."""
    x = trial.suggest_float("x", -3.0, 3.0)
    kind = trial.suggest_categorical("kind", ["a", "b"])
    for step in range(3):
        trial.report((x - 1.0) ** 2 + 1.0 / (step + 1), step)
    return (x - 1.0) ** 2 + (0.0 if kind == "a" else 0.5)


class SlowFusableCNN(VisionCNN):
    """The small CNN with ``sleep_s`` of sleep in every batch it makes: fused groups of it stay busy long
    enough to be interrupted (``SlowCNN`` sleeps in the solo loop, which a fused group does not run)."""

    name = "slow_fusable_cnn"
    defaults = {**VisionCNN.defaults, "sleep_s": 0.05}

    def build(self, p, device):
        import time

        parts = super().build(p, device)
        inner = parts.batch

        def batch(step):
            time.sleep(float(p["sleep_s"]))
            return inner(step)

        parts.batch = batch
        return parts


ESTIMATES: list[dict] = []  # the parameters of every estimate EstimateRecordingCNN traced in this process


class EstimateRecordingCNN(VisionCNN):
    """The CNN; records each meta-device estimate the driver (this process) traces."""

    def estimate(self, params):
        ESTIMATES.append(dict(params))
        return super().estimate(params)
