"""Training-dynamics study: train a tiny byte-level MoE on local text and record affinity per checkpoint.

ExFlow (arXiv 2401.08383, section 3.3) reports that inter-layer affinity appears early in training and then
stabilises. :func:`train` checks that on any machine: the corpus is the Python standard library's own source
(:func:`stdlib_corpus`), the model a :class:`hpdl.models.gpt_moe.MoEDecoder` with a 256-byte vocabulary, and
at every checkpoint a trace of held-out text gives the affinity statistics (:func:`hpdl.moe.affinity.summary`)
next to the shuffled-token baseline.

Loss: next-byte cross-entropy plus the Switch Transformer load-balancing loss (arXiv 2101.03961, eq. 4),
``aux = E * sum_e f_e * P_e`` per MoE layer, so no expert collapses (which would make placement trivial).
"""

from __future__ import annotations

import math
import os
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hpdl.models.gpt_moe import MoEConfig, MoEDecoder, save_checkpoint
from hpdl.moe import affinity
from hpdl.moe.errors import MoEError
from hpdl.moe.trace import collect_trace
from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.limits import check_fits, count, real
from hpdl.runtime.options import Options, option


@dataclass(kw_only=True)
class TrainOptions(Options):
    """A run of :func:`train` (``hpdl moe train`` generates its flags from the fields with help).

    The model is a byte-level :class:`~hpdl.models.gpt_moe.MoEDecoder` with every layer MoE, 4 query and 4 KV
    heads and experts of ``2 * hidden`` units (:meth:`model_config`).

    Raises:
        CLIUsageError: ``hidden`` not a multiple of 8, or ``top_k > experts`` (named by their flags).
    """

    steps: int = option(1500, type=count(0), help="optimizer steps (AdamW)")
    batch: int = option(16, type=count(1, 1 << 16), help="sequences per step")
    seq: int = option(128, type=count(2, 1 << 16), help="sequence length in bytes (tokens)")
    layers: int = option(4, type=count(2, 1024),
                         help="decoder layers, every one MoE (>= 2: affinity is between layers)")
    experts: int = option(8, type=count(1, 4096), help="routed experts per MoE layer")
    hidden: int = option(96, type=count(8, 1 << 16),
                         help="hidden size (4 heads; a multiple of 8); experts have 2x hidden units")
    top_k: int = option(1, type=count(1, 4096), help="experts per token (ExFlow mode needs 1)")
    checkpoints: int = option(11, type=count(1, 10_000), help="evenly spaced steps (0 and the last included) at "
                              "which affinity of held-out text is recorded")
    lr: float = option(3e-3, type=real(0, 10, strict=True), help="AdamW learning rate")
    max_bytes: int = option(6_000_000, type=count(1, 1 << 34), help="bytes of the stdlib source read (head in "
                            "sorted path order; the last 1%% + trace tokens are held out)")
    # None (a library caller's default): nothing is written
    out: str | None = option(None, required=True, help="directory: hpdl_moe.pt, history.json, affinity.png")
    aux_coef: float = 0.01           # weight of the Switch load-balancing loss
    trace_tokens: int = 4096         # held-out tokens traced at every checkpoint
    seed: int = 0
    threads: int | None = None       # torch.set_num_threads (None: torch's default)

    def __post_init__(self):
        if self.hidden % 8:   # 4 heads of an even head_dim (rotary embedding rotates pairs)
            raise CLIUsageError(f"--hidden must be a multiple of 8 (4 attention heads, each of an even size), got "
                                f"{self.hidden}")
        if self.top_k > self.experts:
            raise CLIUsageError(f"--top-k must be <= --experts={self.experts}, got {self.top_k}")

    def model_config(self) -> MoEConfig:
        """The byte-level model these options train."""
        return MoEConfig(vocab_size=256, hidden_size=self.hidden, n_layers=self.layers, n_heads=4, n_kv_heads=4,
                         n_experts=self.experts, top_k=self.top_k, expert_size=2 * self.hidden,
                         max_position=max(256, self.seq))


def stdlib_corpus(max_bytes: int = 4_000_000, root: str | Path | None = None,
                  part: str = "head") -> tuple[np.ndarray, str]:
    """Bytes of the ``*.py`` files under ``root`` (default: this interpreter's stdlib, without test suites and
    site-packages), concatenated up to ``max_bytes``. ``part="head"`` takes files in sorted path order (what
    :func:`train` reads), ``part="tail"`` in reverse order, so a trace of the tail is text the model never saw
    as long as both parts together stay under the corpus size (about 13 MB for CPython 3.11).
    Returns ``(uint8 array, source description)``."""
    if part not in ("head", "tail"):
        raise MoEError(f"part must be 'head' or 'tail', got {part!r}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for d, dirs, names in os.walk(root):  # prune while walking: site-packages can hold gigabytes
        dirs[:] = [x for x in dirs if x not in ("site-packages", "dist-packages", "test", "__pycache__")]
        files.extend(Path(d) / n for n in names if n.endswith(".py"))
    files.sort()
    if part == "tail":
        files.reverse()
    if not files:
        raise MoEError(f"root={root}: no *.py files")
    buf, n = [], 0
    for p in files:
        try:
            b = p.read_bytes()
        except OSError:
            continue
        buf.append(b)
        n += len(b)
        if n >= max_bytes:
            break
    data = np.frombuffer(b"".join(buf)[:max_bytes], dtype=np.uint8).copy()
    return data, f"stdlib-{part}:{root} ({len(buf)} files, {len(data)} bytes)"


def batches(data: np.ndarray, batch: int, seq: int, seed: int):
    """Endless random windows ``[batch, seq+1]`` int64 of ``data``."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        yield torch.from_numpy(np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int64))


def load_balance_loss(router_logits: list[torch.Tensor], experts: list[torch.Tensor], n_experts: int) -> torch.Tensor:
    """Switch load-balancing loss averaged over MoE layers (1.0 when perfectly balanced)."""
    tot = 0.0
    for lg, idx in zip(router_logits, experts):
        p = torch.softmax(lg.float(), -1).mean(0)
        f = torch.bincount(idx[:, 0], minlength=n_experts).float() / idx.shape[0]
        tot = tot + n_experts * (f * p).sum()
    return tot / len(router_logits)


def heldout_windows(data: np.ndarray, n_tokens: int, seq: int) -> np.ndarray:
    """Non-overlapping windows ``[n, seq]`` from the tail of ``data`` (never sampled for training)."""
    n = max(1, n_tokens // seq)
    tail = data[-n * seq:]
    return tail.reshape(n, seq).astype(np.int64)


def train(options: TrainOptions, progress: Callable[[str], None] | None = print) -> tuple[MoEDecoder, dict]:
    """Train a byte-level MoE (:meth:`TrainOptions.model_config`) on the stdlib corpus; record affinity at
    ``options.checkpoints`` evenly spaced steps (step 0 = initialisation included). The last
    ``trace_tokens + 1%`` of the corpus is held out.

    Returns ``(model, history)``; history is plain data: config, options, corpus, per-checkpoint step, loss and
    :func:`hpdl.moe.affinity.summary` of a held-out trace. With ``options.out`` the final model is saved there
    (``hpdl_moe.pt``) with ``history.json`` and its plot (``affinity.png``, :func:`plot_history`).

    Raises:
        InsufficientMemoryError: the model, its AdamW state and a batch's activations cannot fit in host memory
            (checked before anything is allocated).
        MoEError: ``max_bytes`` too small for the held-out text.
    """
    o = options
    steps, batch, seq, checkpoints, seed = o.steps, o.batch, o.seq, o.checkpoints, o.seed
    cfg = o.model_config()
    # weights + AdamW's two moments + gradients (fp32), the experts' SwiGLU dominating; activations of a batch
    h = o.hidden
    params = o.layers * (4 * h * h + o.experts * 3 * h * 2 * h) + 2 * 256 * h
    acts = batch * seq * h * o.layers * 16
    check_fits(4 * (4 * params + acts), "--hidden/--experts/--layers/--batch/--seq",
               what=f"a {params / 1e6:.0f}M-parameter MoE trained at batch {batch} x {seq}")
    if o.threads:
        torch.set_num_threads(o.threads)
    torch.manual_seed(seed)
    data, source = stdlib_corpus(o.max_bytes)
    hold = o.trace_tokens + len(data) // 100
    if len(data) < hold + 10 * seq:
        raise MoEError(f"max_bytes={o.max_bytes} is too small for trace_tokens={o.trace_tokens}")
    train_data, held = data[:-hold], data[-hold:]
    windows = heldout_windows(held, o.trace_tokens, seq)
    model = MoEDecoder(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=0.0)
    at = sorted({0, steps} | {round(steps * c / max(1, checkpoints - 1)) for c in range(checkpoints)})
    history = {"config": cfg.__dict__ | {}, "options": asdict(o), "corpus": source, "steps": steps, "batch": batch,
               "seq": seq, "checkpoints": []}
    it = batches(train_data, batch, seq, seed)
    loss_ema = float("nan")
    t0 = time.perf_counter()

    def record(step):
        tr = collect_trace(model, windows, source=source + ":heldout")
        s = affinity.summary(tr.experts, cfg.n_experts, seed)
        history["checkpoints"].append({"step": step, "loss": loss_ema, "affinity": s})
        model.train()
        if progress:
            m = s["mean"]
            progress(f"step {step}/{steps} loss {'-' if math.isnan(loss_ema) else f'{loss_ema:.3f}'} mean-max-cond {m['mean_max_conditional']:.3f} "
                     f"(shuffled {m['shuffled_mean_max_conditional']:.3f}, uniform {1 / cfg.n_experts:.3f}) "
                     f"MI {m['mutual_information_bits']:.3f} bits  [{time.perf_counter() - t0:.0f}s]")

    model.train()
    for step in range(steps + 1):
        if step in at:
            record(step)
        if step == steps:
            break
        xy = next(it)
        logits, lg, idx = model(xy[:, :-1], return_routing=True)
        ce = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), xy[:, 1:].reshape(-1))
        loss = ce + o.aux_coef * load_balance_loss(lg, idx, cfg.n_experts)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ce_v = float(ce.detach())
        loss_ema = ce_v if math.isnan(loss_ema) else 0.9 * loss_ema + 0.1 * ce_v
    model.eval()
    history["seconds"] = time.perf_counter() - t0
    if o.out is not None:
        import json

        save_checkpoint(model, o.out, extra={"corpus": source})
        (Path(o.out) / "history.json").write_text(json.dumps(history, indent=1))
        plot_history(history, Path(o.out) / "affinity.png")
    return model, history


def plot_history(history: dict, path) -> None:
    """Affinity (mean max-conditional, trace vs shuffled vs uniform) and MI against training step (PNG)."""
    from hpdl.bench.common import pyplot

    plt = pyplot()

    ck = history["checkpoints"]
    steps = [c["step"] for c in ck]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(steps, [c["affinity"]["mean"]["mean_max_conditional"] for c in ck], "o-", label="trace")
    a.plot(steps, [c["affinity"]["mean"]["shuffled_mean_max_conditional"] for c in ck], "s--", label="shuffled tokens")
    a.axhline(ck[0]["affinity"]["uniform"], color="gray", ls=":", label="uniform 1/E")
    a.set_xlabel("training step")
    a.set_ylabel("load-weighted mean max P(j|i)")
    a.legend()
    b.plot(steps, [c["affinity"]["mean"]["mutual_information_bits"] for c in ck], "o-", label="trace")
    b.plot(steps, [c["affinity"]["mean"]["shuffled_mutual_information_bits"] for c in ck], "s--", label="shuffled")
    b.set_xlabel("training step")
    b.set_ylabel("mutual information (bits)")
    b.legend()
    fig.suptitle(f"inter-layer expert affinity during training ({history['corpus'].split(' (')[0]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
