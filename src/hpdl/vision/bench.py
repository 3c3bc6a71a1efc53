"""``hpdl bench attention``: SOFT against softmax attention, as tokens grow and inside whole models.

    hpdl bench attention                                   # CPU, small sizes: a check of the harness
    hpdl bench attention --device cuda --suite all --out $OUT   # the device run (docs/benchmarks/soft.md)

Suites (``--suite tokens,model,throughput`` or ``all``; ``--suite goal`` alone runs issue 34's goal table,
:mod:`hpdl.vision.soft_goal`: kernel check on the device, then the layer and SOFT-vs-PVTv2 tables):

- ``tokens``: one attention layer, forward and forward+backward time and peak memory, tokens 256..65,536
  (powers of 2; B x heads x head_dim = ``--batch`` x ``--heads`` x ``--head-dim``). Methods: ``soft`` (SOFT:
  Gaussian kernel through ``--landmarks`` segment-mean landmarks of q, 20 Newton steps, the paper's backward,
  Triton kernels on CUDA), ``soft_norm`` (SOFT++), ``soft_exact`` / ``soft_autograd`` (SOFT with the exact
  backward of the truncated iteration / autograd through the 20 steps), ``nystrom`` (Nystromformer, softmax,
  the same landmarks, 6 steps), ``sdpa``
  (``F.scaled_dot_product_attention``; on CUDA with 16-bit inputs the flash kernel is required, so its label is
  honest) and ``softmax`` (materialised, the O(N^2) reference; off unless asked). A method stops after its first
  point that runs out of memory or takes longer than ``--time-limit`` seconds per call.
- ``model``: SOFT-Tiny forward+backward at ``--image-sizes`` (stage 1 holds (size/4)^2 tokens: 512 px = 16,384)
  with its own attention and with softmax SDPA over the same tied Q/K (``attention="sdpa"``), images/s and peak
  memory. The paper's landmarks come from a fixed-stride conv, so the landmark count m grows with the image
  (m = (size/32)^2 in every SOFT stage) and the float32 Newton iteration, O(m^3) per head, takes over; the
  ``soft_inverse`` row (``--model-attentions``) prices the model with the paper's backward to show that share.
- ``throughput``: images/s at ``--image-size`` (inference at ``--infer-batch``, training fwd+bwd at
  ``--train-batch``) of SOFT models next to timm ViT/PVT baselines, with each model's multiply-adds counted by
  ``torch.utils.flop_counter`` on the same device; each SOFT model is paired with the baseline of nearest MACs.

Timing: CUDA events (or perf_counter on CPU) per call after ``--warmup`` calls, median of ``--reps``; peak memory
is ``torch.cuda.max_memory_allocated`` above what was allocated before the call (CUDA only). Writes
``soft_bench.json`` and one PNG per suite to ``--out``; prints the tables last.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from hpdl.bench.common import (Benchmark, Column, Panel, PlotSpec, command, format_table, main,
                               plot_rows, pyplot, run_metadata, usage_checks)

from hpdl.models.soft_ops import nystrom_attention, soft_attention
from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.limits import count, real
from hpdl.runtime.options import from_namespace
from hpdl.vision.timing import _free, _sdpa_context, measure

METHODS = ("soft", "soft_norm", "soft_inverse", "soft_exact", "soft_autograd", "nystrom", "sdpa", "softmax")
_SOFT = {"soft": ("soft", "inverse"), "soft_norm": ("norm", "inverse"), "soft_inverse": ("soft", "inverse"),
         "soft_exact": ("soft", "exact"), "soft_autograd": ("soft", "autograd")}  # method -> (variant, NR backward)
SUITES = ("tokens", "model", "throughput")
DEFAULT_BASELINES = "deit_tiny_patch16_224,pvt_v2_b1,pvt_v2_b2,deit_small_patch16_224"


# ----------------------------------------------------------------------------------------------------- options
# What each suite measures (defaults: the CPU run; ``hpdl bench attention`` fills in the CUDA sizes). Timing of
# every point: ``warmup`` untimed calls, then the median of ``reps`` timed calls.

@dataclass(kw_only=True)
class TokensSuite:
    """:func:`run_tokens`: one attention layer, ``[batch, heads, N, head_dim]`` inputs, N doubling from
    ``min_tokens`` to ``max_tokens``."""

    methods: list[str] = field(default_factory=lambda: ["soft", "soft_norm", "nystrom", "sdpa"])  # of METHODS
    min_tokens: int = 256
    max_tokens: int = 4096
    batch: int = 1
    heads: int = 6
    head_dim: int = 64
    landmarks: int = 64          # SOFT and Nystrom landmarks; N not a multiple of it is skipped
    time_limit: float = 5.0      # seconds per call after which a method stops growing
    warmup: int = 3
    reps: int = 10


@dataclass(kw_only=True)
class ModelSuite:
    """:func:`run_model`: ``model`` forward+backward at each of ``image_sizes`` (pixels, multiples of 32) with
    each of ``model_attentions`` (keys of ``MODEL_ATTENTIONS``), ``model_batch`` images a step."""

    model: str = "soft_tiny"
    image_sizes: list[int] = field(default_factory=lambda: [64, 128])
    model_batch: int = 2
    model_attentions: list[str] = field(default_factory=lambda: ["soft", "soft_inverse", "sdpa"])
    warmup: int = 3
    reps: int = 10


@dataclass(kw_only=True)
class ThroughputSuite:
    """:func:`run_throughput`: images/s of ``models`` (SOFT names) and ``baselines`` (timm names) at
    ``image_size`` pixels, inference at ``infer_batch`` and training at ``train_batch``."""

    models: list[str] = field(default_factory=lambda: ["soft_tiny", "soft_small"])
    baselines: list[str] = field(default_factory=lambda: DEFAULT_BASELINES.split(","))
    image_size: int = 64
    infer_batch: int = 4
    train_batch: int = 2
    warmup: int = 3
    reps: int = 10


# ------------------------------------------------------------------------------------------------- tokens suite

def attention(method: str, q, k, v, landmarks: int):
    """One attention of ``METHODS`` on ``[B, H, N, d]`` inputs (SOFT ties keys to queries and ignores k)."""
    b, h, n, d = q.shape
    if method in _SOFT:
        variant, backward = _SOFT[method]
        qs = q * d ** -0.25
        lm = qs.reshape(b, h, landmarks, n // landmarks, d).mean(-2)  # segment means, as Nystromformer's
        return soft_attention(qs, v, lm, variant=variant, backward=backward)
    if method == "nystrom":
        return nystrom_attention(q, k, v, num_landmarks=landmarks)
    if method == "sdpa":
        return F.scaled_dot_product_attention(q, k, v)
    if method == "softmax":
        return torch.softmax((q @ k.transpose(-1, -2)) * d ** -0.5, dim=-1) @ v
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def run_tokens(options: TokensSuite, device, dtype) -> list[dict]:
    """One row per (tokens, method): fwd and fwd+bwd ms and peak MiB, or why it was skipped (``status``)."""
    o = options
    rows, stopped = [], {}
    ctx, sdpa_label = _sdpa_context(device, dtype)
    n = o.min_tokens
    while n <= o.max_tokens:
        for method in o.methods:
            landmarked = method in _SOFT or method == "nystrom"
            row = {"tokens": n, "method": method, "landmarks": o.landmarks if landmarked else None}
            if method == "sdpa":
                row["backend"] = sdpa_label
            if method in stopped:
                rows.append({**row, "status": "skipped", "why": stopped[method]})
                continue
            if landmarked and n % o.landmarks:
                rows.append({**row, "status": "skipped", "why": f"tokens not a multiple of {o.landmarks}"})
                continue
            g = torch.Generator(device=device).manual_seed(n)
            q, k, v = (torch.randn(o.batch, o.heads, n, o.head_dim, device=device, dtype=dtype,
                                   generator=g).requires_grad_() for _ in range(3))
            grad = torch.randn(o.batch, o.heads, n, o.head_dim, device=device, dtype=dtype, generator=g)

            def fwd():
                with torch.no_grad(), ctx():
                    return attention(method, q, k, v, o.landmarks)

            def fwd_bwd():
                for t in (q, k, v):
                    t.grad = None
                with ctx():
                    out = attention(method, q, k, v, o.landmarks)
                out.backward(grad)

            try:
                with ctx():
                    finite = bool(torch.isfinite(fwd()).all())
                f = measure(fwd, device, o.warmup, o.reps)
                fb = measure(fwd_bwd, device, o.warmup, o.reps)
                rows.append({**row, "status": "ok" if finite else "non-finite", "fwd_ms": f["ms"],
                             "fwd_peak_mib": f["peak_mib"], "fwd_bwd_ms": fb["ms"], "fwd_bwd_ms_min": fb["ms_min"],
                             "fwd_bwd_peak_mib": fb["peak_mib"]})
                if fb["ms"] > 1e3 * o.time_limit:
                    stopped[method] = f"{fb['ms'] / 1e3:.1f} s per call at {n} tokens > --time-limit"
            except torch.cuda.OutOfMemoryError:
                rows.append({**row, "status": "oom"})
                stopped[method] = f"out of memory at {n} tokens"
            del q, k, v, grad
            _free(device)
        n *= 2
    return rows


def crossover(rows: list[dict], method: str = "soft", against: str = "sdpa", key: str = "fwd_bwd_ms"):
    """Smallest token count from which ``method`` stays faster than ``against`` (None if never)."""
    times = {}
    for r in rows:
        if r["status"] == "ok":
            times.setdefault(r["tokens"], {})[r["method"]] = r[key]
    ns = sorted(n for n, t in times.items() if method in t and against in t)
    out = None
    for n in reversed(ns):
        if times[n][method] < times[n][against]:
            out = n
        else:
            break
    return out


# -------------------------------------------------------------------------------------------------- model suite

def _autocast(device, dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype in (torch.float16, torch.bfloat16))


MODEL_ATTENTIONS = {"soft": {}, "soft_inverse": {"nr_backward": "inverse"}, "soft_autograd": {"nr_backward": "autograd"},
                    "sdpa": {"attention": "sdpa"}}


def run_model(options: ModelSuite, device, dtype) -> list[dict]:
    """One row per (image size, attention): fwd+bwd ms, images/s and peak MiB, or ``status`` oom."""
    from hpdl.models.soft import create

    o = options
    rows = []
    for size in o.image_sizes:
        for attn in o.model_attentions:
            row = {"model": o.model, "attention": attn, "image_size": size, "batch": o.model_batch,
                   "stage1_tokens": (size // 4) ** 2, "stage1_landmarks": (size // 4 // 8) ** 2
                   if attn.startswith("soft") else None}
            try:
                torch.manual_seed(0)
                model = create(o.model, **MODEL_ATTENTIONS[attn]).to(device)
                x = torch.randn(o.model_batch, 3, size, size, device=device)
                ctx, _ = _sdpa_context(device, dtype)

                def step():
                    for p in model.parameters():
                        p.grad = None
                    with _autocast(device, dtype), ctx():
                        loss = model(x).float().logsumexp(-1).mean()
                    loss.backward()

                m = measure(step, device, o.warmup, o.reps)
                rows.append({**row, "status": "ok", "fwd_bwd_ms": m["ms"], "images_per_s": o.model_batch / m["ms"]
                             * 1e3, "peak_mib": m["peak_mib"]})
            except torch.cuda.OutOfMemoryError:
                rows.append({**row, "status": "oom"})
            finally:
                model = x = None
                _free(device)
    return rows


# --------------------------------------------------------------------------------------------- throughput suite

def _build(name: str, size: int, device):
    if name.startswith("soft_"):
        from hpdl.models.soft import create

        return create(name).to(device)
    import timm

    try:
        return timm.create_model(name, pretrained=False, img_size=size).to(device)
    except TypeError:  # models without an img_size argument (PVT v2 takes any size)
        return timm.create_model(name, pretrained=False).to(device)


def macs(model, size: int, device) -> float:
    """Multiply-adds of one forward of one image (FLOPs / 2 from torch.utils.flop_counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    was = model.training
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, 3, size, size, device=device))
    model.train(was)
    return counter.get_total_flops() / 2


def run_throughput(options: ThroughputSuite, device, dtype) -> list[dict]:
    """One row per model: parameters, GMACs, inference and training images/s; a SOFT row names the baseline of
    nearest multiply-adds (``pair``)."""
    o = options
    rows = []
    for name in [*o.models, *o.baselines]:
        try:
            torch.manual_seed(0)
            model = _build(name, o.image_size, device)
            row = {"model": name, "family": "soft" if name.startswith("soft_") else "timm",
                   "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
                   "gmacs": macs(model, o.image_size, device) / 1e9, "image_size": o.image_size}
            model.eval()
            xi = torch.randn(o.infer_batch, 3, o.image_size, o.image_size, device=device)

            def infer():
                with torch.no_grad(), _autocast(device, dtype):
                    model(xi)

            mi = measure(infer, device, o.warmup, o.reps)
            model.train()
            xt = torch.randn(o.train_batch, 3, o.image_size, o.image_size, device=device)

            def train_step():
                for p in model.parameters():
                    p.grad = None
                with _autocast(device, dtype):
                    loss = model(xt).float().logsumexp(-1).mean()
                loss.backward()

            mt = measure(train_step, device, o.warmup, o.reps)
            rows.append({**row, "status": "ok", "infer_images_per_s": o.infer_batch / mi["ms"] * 1e3,
                         "train_images_per_s": o.train_batch / mt["ms"] * 1e3, "train_peak_mib": mt["peak_mib"]})
        except torch.cuda.OutOfMemoryError:
            rows.append({"model": name, "status": "oom"})
        finally:
            model = xi = xt = None
            _free(device)
    soft = [r for r in rows if r.get("family") == "soft" and r["status"] == "ok"]
    base = [r for r in rows if r.get("family") == "timm" and r["status"] == "ok"]
    for r in soft:  # the baseline of nearest multiply-adds (log scale)
        if base:
            r["pair"] = min(base, key=lambda b: abs(math.log(b["gmacs"] / r["gmacs"])))["model"]
    return rows


# ------------------------------------------------------------------------------------------------- reporting

def _ok(r: dict) -> bool:
    return r["status"] == "ok"


def _status(r: dict) -> str:
    return r["status"] + (f" ({r['why']})" if r.get("why") else "")


def _pair(r: dict) -> str:
    return r.get("pair", "") if r["status"] == "ok" else r["status"]


TOKENS_COLUMNS = (Column("tokens", "tokens"), Column("method", "method"), Column("fwd_ms", "fwd", "ms", ".2f"),
                  Column("fwd_bwd_ms", "fwd+bwd", "ms", ".2f"), Column("fwd_bwd_peak_mib", "peak", "MiB", ".0f"),
                  Column(_status, "status"))
MODEL_COLUMNS = (Column("image_size", "size", "px"), Column("stage1_tokens", "stage-1 tokens"),
                 Column("attention", "attention"), Column("fwd_bwd_ms", "fwd+bwd", "ms", ".2f"),
                 Column("images_per_s", "throughput", "img/s", ".1f"), Column("peak_mib", "peak", "MiB", ".0f"),
                 Column("status", "status"))
THROUGHPUT_COLUMNS = (Column("model", "model"), Column("params_m", "params", "M", ".1f"),
                      Column("gmacs", "MACs", "G", ".2f"), Column("infer_images_per_s", "infer", "img/s", ".0f"),
                      Column("train_images_per_s", "train", "img/s", ".0f"), Column(_pair, "pair"))
TOKENS_PLOT = PlotSpec(x="tokens", xlabel="tokens", xscale="log2", series="method", keep=_ok,
                       panels=(Panel("fwd_bwd_ms", "fwd+bwd ms", "log"), Panel("fwd_bwd_peak_mib", "fwd+bwd peak MiB",
                                                                               "log")))
MODEL_PLOT = PlotSpec(x="stage1_tokens", xlabel="stage-1 tokens ((image size / 4)^2)", xscale="log2",
                      series="attention", keep=_ok,
                      panels=(Panel("fwd_bwd_ms", "fwd+bwd ms per batch", "log"), Panel("peak_mib", "peak MiB", "log")))


def _suite(rows, name: str) -> list[dict]:
    return [r for r in rows if r.get("suite") == name]


def format_tables(rows: list[dict], meta: dict, crossover_n=None) -> str:
    """One table per suite that ran (``rows`` carry their ``suite``)."""
    parts = []
    if _suite(rows, "tokens"):
        parts.append(format_table(_suite(rows, "tokens"), TOKENS_COLUMNS,
                                  "attention layer, fwd+bwd (fwd) ms and peak MiB; " + meta["shape"]))
        parts.append(f"# soft faster than sdpa (fwd+bwd) from {crossover_n} tokens on (None: never in this sweep)")
    if _suite(rows, "model"):
        parts.append(format_table(_suite(rows, "model"), MODEL_COLUMNS,
                                  "model fwd+bwd: " + _suite(rows, "model")[0]["model"]))
    if _suite(rows, "throughput"):
        parts.append(format_table(_suite(rows, "throughput"), THROUGHPUT_COLUMNS,
                                  f"throughput at {meta.get('throughput_image_size')} px"))
    return "\n".join(parts)


def plot(rows: list[dict], meta: dict, out: Path) -> list[str]:
    """One PNG per suite that ran, into the folder ``out``: attention_tokens.png, soft_model.png, throughput.png."""
    written = []
    title = f"{meta['device_name']}, {meta['dtype']}"
    if _suite(rows, "tokens"):
        written.append(plot_rows(_suite(rows, "tokens"), TOKENS_PLOT, out / "attention_tokens.png",
                                 f"attention layer, {meta['shape']}; {title}"))
    model = _suite(rows, "model")
    if model:
        written.append(plot_rows(model, MODEL_PLOT, out / "soft_model.png", f"{model[0]['model']} batch "
                                 f"{model[0]['batch']}: SOFT vs softmax SDPA attention; {title}"))
    ok = [r for r in _suite(rows, "throughput") if r["status"] == "ok"]
    if _suite(rows, "throughput"):
        plt = pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key in zip(axes, ("infer_images_per_s", "train_images_per_s")):
            for r in ok:
                ax.scatter(r["gmacs"], r[key], marker="o" if r["family"] == "soft" else "s",
                           color="C0" if r["family"] == "soft" else "C1")
                ax.annotate(r["model"], (r["gmacs"], r[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
            ax.set_xlabel("GMACs per image")
            ax.set_ylabel(key.replace("_", " "))
            ax.grid(True, alpha=0.3)
        fig.suptitle(f"throughput at {meta['throughput_image_size']} px (SOFT: circles, timm: squares); {title}")
        fig.tight_layout()
        fig.savefig(out / "throughput.png", dpi=120)
        plt.close(fig)
        written.append(str(out / "throughput.png"))
    return written


# ----------------------------------------------------------------------------------------------------- command

def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


class AttentionBenchmark(Benchmark):
    """``hpdl bench attention`` on the harness: the rows of every suite that ran (each with its ``suite``),
    a table per suite, a figure per suite in ``--out`` (default ``$OUT`` or ``.``); exit status 1 when an
    output was not finite. ``--suite goal`` runs :func:`hpdl.vision.soft_goal.run_goal` instead."""

    name, stem = "attention", "soft_bench"
    title = "SOFT vs softmax attention"
    outputs = ("format", "json", "out")

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("--suite", default="tokens", help="comma-separated from tokens, model, throughput, or all; "
                                                         "goal alone: kernel check + goal tables (default: tokens)")
        p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="(default: cpu)")
        p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                       help="inputs (tokens) / autocast (model, throughput) (default: bfloat16 on CUDA, float32 CPU)")
        p.add_argument("--methods", default="soft,soft_norm,nystrom,sdpa",
                       help=f"tokens suite, from {','.join(METHODS)} (default: soft,soft_norm,nystrom,sdpa)")
        # -b/-e as nccl-tests' smallest and largest size (here in tokens, doubling)
        p.add_argument("-b", "--min-tokens", type=count(1, 1 << 24), default=256, help="tokens suite: fewest tokens "
                       "(default: 256)")
        p.add_argument("-e", "--max-tokens", type=count(1, 1 << 24), default=None, help="tokens suite: most tokens "
                       "(default: 65536 on CUDA, 4096 on CPU)")
        p.add_argument("--batch", type=count(1, 1 << 16), default=1, help="tokens suite batch (default: 1)")
        p.add_argument("--heads", type=count(1, 1024), default=6, help="(default: 6)")
        p.add_argument("--head-dim", type=count(1, 4096), default=64, help="(default: 64)")
        p.add_argument("--landmarks", type=count(1, 1 << 16), default=64, help="SOFT and Nystrom landmarks (default: 64)")
        p.add_argument("--time-limit", type=real(0, 86400, strict=True), default=None,
                       help="seconds per call after which a method stops growing (default: 2 on CUDA, 5 on CPU)")
        p.add_argument("--model", default="soft_tiny", help="model suite model (default: soft_tiny)")
        p.add_argument("--image-sizes", default=None, help="model suite sizes (default: 224,384,512,768 on CUDA, "
                                                            "64,128 on CPU)")
        p.add_argument("--model-batch", type=count(1, 1 << 16), default=None, help="(default: 16 on CUDA, 2 on CPU)")
        p.add_argument("--model-attentions", default="soft,soft_inverse,sdpa",
                       help=f"model suite, from {','.join(MODEL_ATTENTIONS)} (default: soft,soft_inverse,sdpa)")
        p.add_argument("--models", default="soft_tiny,soft_small", help="throughput suite SOFT models")
        p.add_argument("--baselines", default=DEFAULT_BASELINES, help=f"timm baselines (default: {DEFAULT_BASELINES})")
        p.add_argument("--image-size", type=count(8, 8192), default=None, help="throughput size (default: 224 CUDA, 64 CPU)")
        p.add_argument("--infer-batch", type=count(1, 1 << 16), default=None, help="(default: 256 on CUDA, 4 on CPU)")
        p.add_argument("--train-batch", type=count(1, 1 << 16), default=None, help="(default: 128 on CUDA, 2 on CPU)")
        p.add_argument("--warmup", type=count(0, 10_000), default=3, help="untimed calls per point (default: 3)")
        p.add_argument("--reps", "--repeats", type=count(1, 10_000), default=10, help="timed calls per point, median reported (default: 10)")
        p.add_argument("--smoke", action="store_true", help="goal suite: tiny shapes (a CPU check of the code; "
                                                            "CPU needs TRITON_INTERPRET=1 for the kernel check)")
        p.add_argument("--goal-parts", default=None,
                       help="goal suite: from layer,eager,compiled (models = eager,compiled), run in the order "
                            "given (default: layer,eager,compiled on CUDA, no compiled on CPU); the kernel check "
                            "always runs first. layer alone: check + eager and CUDA-graphed layer tables")
        p.add_argument("--goal-pairs", default="tiny,small",
                       help="goal suite: model pairs and their order, from tiny (soft_tiny/pvt_v2_b1) and small "
                            "(soft_small/pvt_v2_b2) (default: tiny,small)")
        p.add_argument("--time-budget", type=real(0, 86400, strict=True), default=270.0,
                       help="goal suite: seconds after which remaining model runs are skipped (default: 270)")


    def validate(self, args) -> None:
        cuda = args.device == "cuda"
        if cuda and not torch.cuda.is_available():
            raise CLIUsageError("--device cuda needs a visible GPU")
        suites = list(SUITES) if args.suite == "all" else _csv(args.suite)
        if "goal" in suites:
            if suites != ["goal"]:
                raise CLIUsageError(f"--suite goal runs alone, got {suites}")
            parts = _csv(args.goal_parts or ("layer,eager,compiled" if cuda else "layer,eager"))
            bad = [x for x in parts if x not in ("layer", "eager", "compiled", "models")]
            if bad:
                raise CLIUsageError(f"--goal-parts {bad} unknown; expected some of layer, eager, compiled, models")
            expanded = [y for x in parts for y in (("eager", "compiled") if x == "models" else (x,))]
            args.goal_parts = list(dict.fromkeys(expanded))
            args.goal_pairs = _csv(args.goal_pairs)
            bad = [x for x in args.goal_pairs if x not in ("tiny", "small")] or (
                ["(none)"] if not args.goal_pairs else [])
            if bad or len(set(args.goal_pairs)) != len(args.goal_pairs):
                raise CLIUsageError(f"--goal-pairs must list tiny and/or small once each, got {args.goal_pairs}")
            if not cuda:
                from hpdl.models import soft_kernels

                if not soft_kernels.available(torch.zeros(1)):
                    raise CLIUsageError("--suite goal checks the Triton kernels first: use --device cuda, or set "
                                        "TRITON_INTERPRET=1 (with --smoke) on CPU")
            if args.time_budget <= 0:
                raise CLIUsageError(f"--time-budget must be > 0, got {args.time_budget}")
        bad = [s for s in suites if s not in SUITES + ("goal",)]
        if bad:
            raise CLIUsageError(f"--suite {bad} unknown; expected some of {SUITES} or all")
        args.methods = _csv(args.methods)
        bad = [m for m in args.methods if m not in METHODS]
        if bad:
            raise CLIUsageError(f"--methods {bad} unknown; expected some of {METHODS}")
        args.model_attentions = _csv(args.model_attentions)
        bad = [m for m in args.model_attentions if m not in MODEL_ATTENTIONS]
        if bad:
            raise CLIUsageError(f"--model-attentions {bad} unknown; expected some of {list(MODEL_ATTENTIONS)}")
        if args.landmarks < 1 or args.min_tokens < 1:
            raise CLIUsageError("--landmarks and --min-tokens must be >= 1")
        self.suites = suites
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
        args.max_tokens = args.max_tokens or (65536 if cuda else 4096)
        if "tokens" in suites and args.min_tokens > args.max_tokens:
            raise CLIUsageError(f"-b/--min-tokens ({args.min_tokens}) must not exceed -e/--max-tokens "
                                f"({args.max_tokens})")
        args.time_limit = args.time_limit or (2.0 if cuda else 5.0)
        args.image_sizes = [int(s) for s in _csv(args.image_sizes or ("224,384,512,768" if cuda else "64,128"))]
        if any(s % 32 for s in args.image_sizes):
            raise CLIUsageError(f"--image-sizes must be multiples of 32, got {args.image_sizes}")
        args.model_batch = args.model_batch or (16 if cuda else 2)
        args.models, args.baselines = _csv(args.models), _csv(args.baselines)
        args.image_size = args.image_size or (224 if cuda else 64)
        args.infer_batch = args.infer_batch or (256 if cuda else 4)
        args.train_batch = args.train_batch or (128 if cuda else 2)
        if not args.out_dir and not args.json_path:
            args.out_dir = os.environ.get("OUT") or "."
        self.options = {"tokens": from_namespace(TokensSuite, args), "model": from_namespace(ModelSuite, args),
                        "throughput": from_namespace(ThroughputSuite, args)}
        if suites == ["goal"]:
            from hpdl.vision.soft_goal import GoalOptions

            self.goal = GoalOptions(parts=args.goal_parts, pairs=args.goal_pairs, warmup=args.warmup,
                                    reps=args.reps, time_budget=args.time_budget, smoke=args.smoke)

    def metadata(self, args) -> dict:
        cuda = self.device.type == "cuda"
        return {"device": str(self.device),
                "device_name": torch.cuda.get_device_name(self.device) if cuda else (platform.processor() or "cpu"),
                "dtype": str(self.dtype).replace("torch.", ""),
                "shape": f"B={args.batch} H={args.heads} d={args.head_dim}, {args.landmarks} landmarks",
                "warmup": args.warmup, "reps": args.reps, "throughput_image_size": args.image_size,
                "versions": ("timm",)}

    def run(self, ctx) -> list[dict]:
        device, dtype = self.device, self.dtype
        rows: list[dict] = []
        with ctx.progress(len(self.suites), "attention suites") as bar:
            for suite, fn in (("tokens", run_tokens), ("model", run_model), ("throughput", run_throughput)):
                if suite not in self.suites:
                    continue
                part = fn(self.options[suite], device, dtype)
                rows += [{"suite": suite, **r} for r in part]
                if suite == "tokens":
                    ctx.extra["crossover_soft_vs_sdpa"] = crossover(part)
                bar.advance(f"{suite} suite done ({bar.elapsed:.0f} s)")
        return rows

    def table(self, rows, ctx) -> str:
        m = ctx.meta
        return (f"# {self.invocation(ctx)}: {m['device_name']}, {m['dtype']}, torch {m['torch']}, {m['date']}\n"
                + format_tables(rows, m, ctx.extra.get("crossover_soft_vs_sdpa")))

    def plot(self, rows, path, ctx) -> list[str]:
        return plot(rows, ctx.meta, Path(path))

    def failed(self, rows, ctx) -> bool:
        return any(r["status"] == "non-finite" for r in rows)


class AttentionBenchCommand(command(AttentionBenchmark)):
    """``hpdl bench attention`` (registered in hpdl.bench.cli's PLUGINS); ``--suite goal`` is issue 34's goal run
    (:mod:`hpdl.vision.soft_goal`), its own report, with the harness's metadata."""

    def run(self, args) -> int:
        bench = AttentionBenchmark()
        if _csv(args.suite) != ["goal"]:
            return main(bench, args)
        usage_checks(bench, args)
        from hpdl.vision.soft_goal import run_goal

        out = Path(args.out_dir or os.environ.get("OUT") or ".")
        meta = run_metadata(**bench.metadata(args))
        meta["dtype"] = "bfloat16" if bench.device.type == "cuda" else "float32"
        return run_goal(bench.goal, bench.device, meta, out)
