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
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hpdl.models.gpt_moe import MoEConfig, MoEDecoder, save_checkpoint
from hpdl.moe import affinity
from hpdl.moe.errors import MoEError
from hpdl.moe.trace import collect_trace


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


def train(cfg: MoEConfig | None = None, steps: int = 300, batch: int = 16, seq: int = 64, lr: float = 3e-3,
          aux_coef: float = 0.01, checkpoints: int = 6, trace_tokens: int = 4096, max_bytes: int = 4_000_000,
          out_dir: str | Path | None = None, seed: int = 0, threads: int | None = None,
          progress: Callable[[str], None] | None = print) -> tuple[MoEDecoder, dict]:
    """Train a byte-level MoE on the stdlib corpus; record affinity at ``checkpoints`` evenly spaced steps
    (step 0 = initialisation included). The last ``trace_tokens + 1%`` of the corpus is held out.

    Returns ``(model, history)``; history is plain data: config, corpus, per-checkpoint step, loss and
    :func:`hpdl.moe.affinity.summary` of a held-out trace. With ``out_dir`` the final model is saved there
    (``hpdl_moe.pt``) with ``history.json``.
    """
    if threads:
        torch.set_num_threads(threads)
    cfg = cfg or MoEConfig(vocab_size=256, hidden_size=64, n_layers=4, n_heads=4, n_kv_heads=4, n_experts=8,
                           top_k=1, expert_size=128, max_position=max(256, seq))
    if cfg.vocab_size < 256:
        raise MoEError(f"cfg.vocab_size must be >= 256 for byte-level text, got {cfg.vocab_size}")
    torch.manual_seed(seed)
    data, source = stdlib_corpus(max_bytes)
    hold = trace_tokens + len(data) // 100
    if len(data) < hold + 10 * seq:
        raise MoEError(f"max_bytes={max_bytes} is too small for trace_tokens={trace_tokens}")
    train_data, held = data[:-hold], data[-hold:]
    windows = heldout_windows(held, trace_tokens, seq)
    model = MoEDecoder(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    at = sorted({0, steps} | {round(steps * c / max(1, checkpoints - 1)) for c in range(checkpoints)})
    history = {"config": cfg.__dict__ | {}, "corpus": source, "steps": steps, "batch": batch, "seq": seq,
               "checkpoints": []}
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
        loss = ce + aux_coef * load_balance_loss(lg, idx, cfg.n_experts)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ce_v = float(ce.detach())
        loss_ema = ce_v if math.isnan(loss_ema) else 0.9 * loss_ema + 0.1 * ce_v
    model.eval()
    history["seconds"] = time.perf_counter() - t0
    if out_dir is not None:
        import json

        save_checkpoint(model, out_dir, extra={"corpus": source})
        (Path(out_dir) / "history.json").write_text(json.dumps(history, indent=1))
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
