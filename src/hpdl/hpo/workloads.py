"""Trial workloads: real training with real metrics, no downloads.

- ``cnn``: a small CNN (``depth`` conv-BN-ReLU blocks of ``width`` channels at full resolution, global
  average pool, linear head) on a deterministic synthetic 10-class image task with learnable structure
  (class templates, random shifts, Gaussian noise). Metric: validation accuracy (maximize).
- ``gpt``: a tiny byte-level GPT (nanoGPT layout: pre-LN blocks, causal SDPA, tied embeddings) on the
  corpus shipped in ``hpdl/hpo/data/corpus.txt``. Metric: validation loss in nats per byte (minimize).

A workload is an object with ``build(params, device) -> Parts`` and the shared training loop ``train(ctx)``;
the loop reports every ``eval_every`` steps, honours pruning, checkpoints every ``ctx.checkpoint_every`` evaluations
and resumes exactly (data is a pure function of (seed, step)); ``lr_scale`` gives every trial a learning-rate
warm-up and schedule (``warmup_steps``, ``lr_schedule``). A workload that lists ``fuse_vary`` (the parameters
that may differ between trials of one model shape) can be trained K trials at a time as one fused model
(:mod:`hpdl.hpo.fusion`). ``estimate(params)`` measures parameter
bytes, activation bytes and FLOPs per step on the meta device (no memory is allocated), which the driver
uses before a trial is profiled. Any ``"module:Class"`` path naming a :class:`Workload` subclass works too.
"""

from __future__ import annotations

import functools
import importlib
import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpdl.hpo.errors import HpoConfigError
from hpdl.hpo.fusion import scaled_dot_product_attention


@dataclass
class Parts:
    """What the training loop needs: ``batch(step) -> (x, y)`` is deterministic in (seed, step)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[], float]
    # Fusion (optional; both needed to fuse): validation inputs and targets, and the metric of the model's
    # output on them as a 0-d tensor (``evaluate()`` must equal ``metric(model(val[0]), val[1])`` in eval mode)
    val: tuple[torch.Tensor, torch.Tensor] | None = None
    metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


class Workload(ABC):
    """A trainable objective. Subclasses set ``name``, ``direction``, ``defaults`` and implement ``build``.

    ``defaults`` holds every parameter the workload reads; the study's search space and fixed arguments
    override them. ``structural`` names the parameters that change memory and compute (profiles are
    cached per structural key; learning rates do not need a new profile).
    """

    name = "base"
    direction = "maximize"
    defaults: dict[str, Any] = {}
    structural: tuple[str, ...] = ()
    # Fusion (opt-in, :mod:`hpdl.hpo.fusion`): the parameters that may differ between the trials of one fused
    # model (optimizer hyper-parameters, schedule, seeds). Every other parameter must be equal: it may change
    # a shape. Empty: the workload is not fusable.
    fuse_vary: tuple[str, ...] = ()

    def fusion_key(self, params: dict[str, Any]) -> str:
        """Trials with equal keys can be trained as one fused model: the workload and every resolved parameter
        not in ``fuse_vary``."""
        p = self.resolve(params)
        return self.name + "|" + ",".join(f"{k}={p[k]!r}" for k in sorted(p) if k not in self.fuse_vary)

    def data_key(self, params: dict[str, Any]) -> Any:
        """Trials of one fused model with equal non-None keys get the same ``batch(step)`` and ``val``, so the
        fused loop makes them once (a promise of the workload). Default None: each trial its own."""
        return None

    @staticmethod
    def lr_scale(p: dict[str, Any], step: int) -> float:
        """Factor on the base learning rate at ``step`` (0-based) of resolved parameters ``p``: a linear
        warm-up over ``warmup_steps`` (``(step + 1) / warmup_steps``), then constant (``lr_schedule:
        constant``) or a cosine decay to 0 at the last step (``cosine``). 1.0 when neither is set."""
        warm = int(p.get("warmup_steps", 0) or 0)
        scale = min(1.0, (step + 1) / warm) if warm > 0 else 1.0
        sched = p.get("lr_schedule", "constant")
        if sched == "cosine":
            steps = Workload.schedule(p)[0]
            frac = min(1.0, max(0.0, (step - warm) / max(1, steps - warm)))
            scale *= 0.5 * (1.0 + math.cos(math.pi * frac))
        elif sched != "constant":
            raise HpoConfigError(f"lr_schedule={sched!r}, expected 'constant' or 'cosine'")
        return scale

    def resolve(self, params: dict[str, Any]) -> dict[str, Any]:
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise HpoConfigError(f"workload {self.name!r}: unknown parameters {sorted(unknown)}, "
                                 f"expected a subset of {sorted(self.defaults)}")
        return {**self.defaults, **params}

    def structural_key(self, params: dict[str, Any]) -> str:
        p = self.resolve(params)
        return self.name + ":" + ",".join(f"{k}={p[k]}" for k in self.structural)

    @abstractmethod
    def build(self, params: dict[str, Any], device: torch.device) -> Parts:
        """Model, optimizer, data and evaluation for resolved ``params`` on ``device``."""

    def train(self, ctx) -> float:
        """Run the trial to its last step; return the final metric. ``ctx`` is a
        :class:`hpdl.hpo.trial.TrialContext`. Raises ``optuna.TrialPruned`` when the pruner says so."""
        import optuna

        p = self.resolve(ctx.params)
        torch.manual_seed(int(p["seed"]))
        parts = self.build(p, ctx.device)
        start, value = 0, float("nan")
        state = ctx.load_checkpoint()
        if state is not None:
            parts.model.load_state_dict(state["model"])
            parts.optimizer.load_state_dict(state["optimizer"])
            start, value = int(state["step"]), float(state["value"])
        steps, every = self.schedule(p)
        # what to save if the driver preempts the trial between steps (device removed, migration)
        ctx.state_fn = lambda step: {"model": parts.model.state_dict(), "optimizer": parts.optimizer.state_dict(),
                                     "step": step, "value": value}
        losses = getattr(ctx, "losses", None)  # a list: the training loss of every step is kept (tests)
        base_lr = [g.setdefault("initial_lr", g["lr"]) for g in parts.optimizer.param_groups]
        parts.model.train()
        for step in range(start, steps):
            with ctx.step(step):
                x, y = parts.batch(step)
                loss = parts.loss(parts.model(x), y)
                parts.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                scale = self.lr_scale(p, step)
                for g, lr in zip(parts.optimizer.param_groups, base_lr):
                    g["lr"] = lr * scale
                parts.optimizer.step()
                if losses is not None:
                    losses.append(loss.detach())
            done = step + 1
            if done % every == 0 or done == steps:
                value = parts.evaluate()
                ctx.report(value, done)
                if ctx.should_prune():
                    raise optuna.TrialPruned(f"pruned at step {done} with value {value:.4g}")
                if ctx.checkpoint_every and (done // every) % ctx.checkpoint_every == 0:
                    ctx.save_checkpoint({"model": parts.model.state_dict(), "step": done, "value": value,
                                         "optimizer": parts.optimizer.state_dict()})
        return value

    @staticmethod
    def schedule(p: dict[str, Any]) -> tuple[int, int]:
        """(steps, eval_every) of resolved parameters. With ``samples > 0`` the trial trains on a fixed
        number of samples (equal epochs whatever the batch size): ``steps = max(min_steps, samples //
        batch_size)``; with ``evals > 0`` it evaluates ``evals`` times, else every ``eval_every`` steps."""
        steps = int(p["steps"])
        if int(p.get("samples", 0)) > 0:
            steps = max(int(p.get("min_steps", 20)), int(p["samples"]) // int(p["batch_size"]))
        every = max(1, steps // int(p["evals"])) if int(p.get("evals", 0)) > 0 else int(p["eval_every"])
        return steps, every

    def estimate(self, params: dict[str, Any]) -> dict[str, float]:
        """Static cost of one training step, measured on the meta device.

        Returns:
            ``param_bytes`` (weights), ``activation_bytes`` (sum of module outputs of one forward, bytes),
            ``flops`` (forward + backward FLOPs of one step, ``torch.utils.flop_counter``).
        """
        from torch.utils.flop_counter import FlopCounterMode

        p = self.resolve(params)
        parts = self.build(p, torch.device("meta"))
        act = [0]

        def hook(_m, _i, out):
            if isinstance(out, torch.Tensor):
                act[0] += out.numel() * out.element_size()

        leaves = [m for m in parts.model.modules() if not list(m.children())]
        handles = [m.register_forward_hook(hook) for m in leaves]
        x, y = parts.batch(0)
        with FlopCounterMode(display=False) as fc:
            parts.loss(parts.model(x), y).backward()
        for h in handles:
            h.remove()
        pbytes = sum(q.numel() * q.element_size() for q in parts.model.parameters())
        return {"param_bytes": float(pbytes), "activation_bytes": float(act[0]), "flops": float(fc.get_total_flops())}


# ---------------------------------------------------------------- vision: small CNN on synthetic images
class SmallCNN(nn.Module):
    """``depth`` x (conv3x3 -> BatchNorm -> ReLU) at full resolution, then global pool and a linear head.
    Input (B, 3, S, S) float32, output (B, classes) logits."""

    def __init__(self, width: int, depth: int, classes: int = 10):
        super().__init__()
        layers, c = [], 3
        for _ in range(depth):
            layers += [nn.Conv2d(c, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
            c = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.features(x)              # (B, width, S, S)
        return self.head(h.mean((2, 3)))  # (B, classes)


def synthetic_images(seed: int, step: int, batch: int, size: int, device: torch.device, noise: float = 1.0,
                     classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of the synthetic task: x (batch, 3, size, size) float32, y (batch,) int64, on ``device``.

    Each class has a smooth template (seeded by ``seed`` only); a sample is its class template rolled by a
    per-batch shift of up to size/8 pixels plus N(0, noise^2) pixel noise. Deterministic in (seed, step) for
    a given device type; generated on the device with no host synchronisation (profiling relies on that).
    """
    if device.type == "meta":
        return (torch.empty(batch, 3, size, size, device=device),
                torch.empty(batch, dtype=torch.long, device=device))
    templates = _templates(seed, size, classes, str(device))
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + step + 1)
    y = torch.randint(0, classes, (batch,), generator=g, device=device)
    shift = random.Random(seed * 7_919 + step).randint(-(size // 8), size // 8)
    x = templates[y].roll(shift, dims=3) + noise * torch.randn(batch, 3, size, size, generator=g, device=device)
    return x, y


@functools.lru_cache(maxsize=8)
def _templates(seed: int, size: int, classes: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(classes, 3, 4, 4, generator=g)
    return (F.interpolate(base, size=(size, size), mode="bilinear", align_corners=False) * 1.5).to(device)


class VisionCNN(Workload):
    """Small CNN on the synthetic image task; metric is validation accuracy (fraction in [0, 1])."""

    name = "cnn"
    direction = "maximize"
    defaults = {"width": 32, "depth": 2, "batch_size": 128, "image_size": 32, "lr": 0.05, "momentum": 0.9,
                "weight_decay": 5e-4, "steps": 100, "eval_every": 25, "seed": 0, "data_seed": 7,
                "noise": 1.0, "val_size": 512, "samples": 0, "min_steps": 20, "evals": 0, "warmup_steps": 0,
                "lr_schedule": "constant"}
    structural = ("width", "depth", "batch_size", "image_size")
    fuse_vary = ("lr", "momentum", "weight_decay", "warmup_steps", "lr_schedule", "seed", "data_seed")

    def data_key(self, params):
        return int(self.resolve(params)["data_seed"])  # batches and validation set depend on it alone

    def build(self, p, device):
        model = SmallCNN(int(p["width"]), int(p["depth"])).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=float(p["lr"]), momentum=float(p["momentum"]),
                              weight_decay=float(p["weight_decay"]))
        size, ds, noise = int(p["image_size"]), int(p["data_seed"]), float(p["noise"])
        val = synthetic_images(ds, -1, int(p["val_size"]), size, device, noise) if device.type != "meta" else None

        def evaluate() -> float:
            model.eval()
            with torch.no_grad():
                acc = float(_accuracy(model(val[0]), val[1]))
            model.train()
            return acc

        return Parts(model, opt, lambda s: synthetic_images(ds, s, int(p["batch_size"]), size, device, noise),
                     F.cross_entropy, evaluate, val, _accuracy)


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Fraction of rows of ``logits`` (N, classes) whose arg-max is ``y`` (N,), a 0-d float32 tensor."""
    return (logits.argmax(-1) == y).float().mean()


# ---------------------------------------------------------------- language: tiny GPT on the shipped corpus
class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        # fusion's SDPA: the torch function alone; under a fused model's vmap, one call on (K * B, nh, T, hs)
        a = scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Byte-level GPT: tokens (B, T) int64 -> logits (B, T, 256)."""

    def __init__(self, n_layer: int, n_head: int, n_embd: int, block_size: int, vocab: int = 256):
        super().__init__()
        if n_embd % n_head:
            raise HpoConfigError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.tok, self.pos = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as GPT-2
        for m in self.modules():  # GPT-2 initialisation: N(0, 0.02), zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, C)
        return self.head(self.ln_f(self.blocks(x)))                       # (B, T, vocab)


def load_corpus() -> torch.Tensor:
    """The shipped corpus as a uint8 tensor (bytes)."""
    data = resources.files("hpdl.hpo").joinpath("data/corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class LanguageGPT(Workload):
    """Tiny GPT on the shipped corpus (90 % train, 10 % validation); metric is validation loss (nats/byte)."""

    name = "gpt"
    direction = "minimize"
    defaults = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "batch_size": 32, "lr": 3e-3,
                "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.999, "steps": 100, "eval_every": 25, "seed": 0,
                "val_batches": 8, "samples": 0, "min_steps": 20, "evals": 0, "warmup_steps": 0,
                "lr_schedule": "constant"}
    structural = ("n_layer", "n_head", "n_embd", "block_size", "batch_size")
    fuse_vary = ("lr", "weight_decay", "beta1", "beta2", "warmup_steps", "lr_schedule", "seed")

    def data_key(self, params):
        return int(self.resolve(params)["seed"])  # the batch order; the validation windows are fixed

    def build(self, p, device):
        T, B = int(p["block_size"]), int(p["batch_size"])
        model = TinyGPT(int(p["n_layer"]), int(p["n_head"]), int(p["n_embd"]), T).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=float(p["lr"]), weight_decay=float(p["weight_decay"]),
                                betas=(float(p["beta1"]), float(p["beta2"])))
        if device.type == "meta":
            def batch(_s):
                t = torch.empty(B, T, dtype=torch.long, device=device)
                return t, t
            return Parts(model, opt, batch, _lm_loss, lambda: math.nan)
        data = load_corpus().long()
        split = int(0.9 * len(data))
        if split <= T + 1 or len(data) - split <= T + 1:
            raise HpoConfigError(f"block_size={T} too long for the corpus ({len(data)} bytes)")
        train, val = data[:split].to(device), data[split:].to(device)
        offs = torch.arange(T, device=device)

        def windows(src, gen, n):  # n random windows, gathered on the device (no host sync)
            ix = torch.randint(0, len(src) - T - 1, (n, 1), generator=gen, device=device) + offs  # (n, T)
            return src[ix], src[ix + 1]

        def batch(step):
            g = torch.Generator(device=device).manual_seed(int(p["seed"]) * 1_000_003 + step + 1)
            return windows(train, g, B)

        vx, vy = windows(val, torch.Generator(device=device).manual_seed(12345), int(p["val_batches"]) * 8)

        def evaluate() -> float:
            model.eval()
            with torch.no_grad():
                loss = float(_lm_loss(model(vx), vy))
            model.train()
            return loss

        return Parts(model, opt, batch, _lm_loss, evaluate, (vx, vy), _lm_loss)


def _lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


WORKLOADS: dict[str, type[Workload]] = {"cnn": VisionCNN, "gpt": LanguageGPT}


OBJECTIVE_PREFIX = "objective:"
_OBJECTIVES: dict[str, Callable] = {}  # objectives handed to hpdl.hpo.optimize in this process, by reference


class ObjectiveWorkload(Workload):
    """An Optuna objective ``objective(trial) -> float`` run as a workload (:func:`hpdl.hpo.optimize`).

    The objective is Optuna's define-by-run function: it calls ``trial.suggest_*`` (the study's sampler runs in
    the worker process, reseeded per process so that workers do not draw the same values),
    ``trial.report`` / ``trial.should_prune`` and may raise ``optuna.TrialPruned``. It has no parameters of
    its own to resolve, no model the driver could trace, and no checkpoint: a trial stopped by an interrupt
    or a removed device runs again from its start, with the parameters it had already drawn. Every trial
    shares one profile key, and since nothing here marks training steps the trials are placed on the
    policy's guess for unprofiled trials (``pack``: ``unprofiled_compute`` 0.25, so up to four per GPU
    time-sliced); use a :class:`Workload` for measured packing and checkpoints.
    """

    name = "objective"
    direction = "minimize"
    define_by_run = True

    def __init__(self, fn: Callable):
        self.fn = fn

    def resolve(self, params: dict[str, Any]) -> dict[str, Any]:
        return dict(params)

    def structural_key(self, params: dict[str, Any]) -> str:
        return "objective"

    def build(self, params, device):  # pragma: no cover - train() never builds
        raise HpoConfigError("an objective(trial) workload has no model to build")

    def estimate(self, params: dict[str, Any]) -> dict[str, float]:
        return {"param_bytes": 0, "activation_bytes": 0, "flops": 0.0}  # unknown: measured by running

    @staticmethod
    def schedule(p: dict[str, Any]) -> tuple[int, int]:
        return 1, 1

    def train(self, ctx) -> float:
        import warnings

        with warnings.catch_warnings():  # a trial run again re-reports steps it reported before its stop
            warnings.filterwarnings("ignore", message="The reported value is ignored because", category=UserWarning)
            return float(self.fn(ctx.trial))


def objective_ref(fn: Callable) -> str:
    """The workload name under which worker processes find ``fn``: ``"objective:module:qualname"``, or
    ``"objective:file=/path/script.py:qualname"`` for a function of the script being run (``__main__``,
    imported again by path in each worker, so its ``optimize`` call must sit under
    ``if __name__ == "__main__":``, as with ``multiprocessing``).

    Raises:
        HpoConfigError: ``fn`` is not a module-level function (a lambda, a nested function, or one typed
            into an interactive session), which a worker process could not import.
    """
    import os
    import sys

    qual = getattr(fn, "__qualname__", "")
    if not callable(fn) or not qual or "<" in qual:
        raise HpoConfigError(f"objective={fn!r}: expected a module-level function objective(trial) -> float "
                             "(worker processes import it; lambdas and nested functions cannot be imported)")
    mod = getattr(fn, "__module__", None)
    if mod == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if not path:
            raise HpoConfigError("objective: defined in an interactive session; define it in a module or a "
                                 "script file (worker processes import it)")
        ref = f"{OBJECTIVE_PREFIX}file={os.path.abspath(path)}:{qual}"
    else:
        ref = f"{OBJECTIVE_PREFIX}{mod}:{qual}"
    _OBJECTIVES[ref] = fn
    return ref


def _load_objective(name: str) -> Callable:
    import importlib.util
    import sys

    ref = name[len(OBJECTIVE_PREFIX):]
    where, _, qual = ref.rpartition(":")
    try:
        if where.startswith("file="):
            key = "__hpdl_objective_main__"
            mod = sys.modules.get(key)
            if mod is None or getattr(mod, "__file__", None) != where[5:]:
                spec = importlib.util.spec_from_file_location(key, where[5:])
                if spec is None or spec.loader is None:
                    raise ImportError(f"cannot load {where[5:]!r}")
                mod = importlib.util.module_from_spec(spec)
                sys.modules[key] = mod
                spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(where)
        obj = mod
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, OSError) as exc:
        raise HpoConfigError(f"workload={name!r} cannot be imported: {exc}") from None
    return obj


def get_workload(name: str) -> Workload:
    """``"cnn"``, ``"gpt"``, ``"package.module:Class"`` (a :class:`Workload` subclass) or an objective
    reference made by :func:`objective_ref` -> instance.

    Raises:
        HpoConfigError: unknown name, unimportable path, or a class that is not a Workload.
    """
    if name in WORKLOADS:
        return WORKLOADS[name]()
    if name.startswith(OBJECTIVE_PREFIX):
        return ObjectiveWorkload(_OBJECTIVES.get(name) or _load_objective(name))
    if ":" not in name:
        raise HpoConfigError(f"workload={name!r}, expected one of {sorted(WORKLOADS)} or 'module:Class'")
    mod, _, cls = name.partition(":")
    try:
        obj = getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as exc:
        # the `hpdl` script, unlike `python -m`, does not put the current directory on sys.path
        hint = (f" (the driver and its workers import it from sys.path: put its directory there, e.g. "
                f"`PYTHONPATH=. hpdl hpo run ...`)" if isinstance(exc, ModuleNotFoundError) else "")
        raise HpoConfigError(f"workload={name!r} cannot be imported: {exc}{hint}") from None
    if not (isinstance(obj, type) and issubclass(obj, Workload)):
        raise HpoConfigError(f"workload={name!r} is not a hpdl.hpo.workloads.Workload subclass")
    return obj()
