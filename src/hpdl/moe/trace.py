"""Routing traces: the expert every token chose at every MoE layer, with the identity of model and data.

A trace is a plain object (:class:`Trace`) holding ``experts [N, L, k] int16`` (N tokens, L MoE layers, k = top-k
slots in router order) and ``meta`` (model config hash, weights hash, data sha256 and source). Stored as a
compressed ``.npz`` (one array + one JSON string), about ``2*L*k`` bytes per token.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpdl.moe.errors import MoEError

FORMAT = "hpdl.moe.trace/1"


@dataclass
class Trace:
    """``experts [N, L, k]`` int16 expert ids; ``meta`` dict (n_experts, top_k, moe_layers, model, data)."""

    experts: np.ndarray
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.experts = np.asarray(self.experts)
        if self.experts.ndim != 3:
            raise MoEError(f"experts must be [tokens, layers, k], got shape {self.experts.shape}")
        if self.experts.dtype.kind not in "iu":  # a float id would be truncated silently by the int16 cast
            raise MoEError(f"experts must hold integer expert ids, got dtype {self.experts.dtype}")
        if self.experts.size and (self.experts.min() < 0 or self.experts.max() > np.iinfo(np.int16).max):
            raise MoEError(f"experts must be ids in [0, 32767] (stored as int16), got [{self.experts.min()}, "
                           f"{self.experts.max()}]")
        self.experts = self.experts.astype(np.int16, copy=False)

    @property
    def n_experts(self) -> int:
        if "n_experts" in self.meta:  # not meta.get(..., max()): that default is evaluated on an empty trace too
            return int(self.meta["n_experts"])
        if not self.experts.size:
            raise MoEError("an empty trace without meta['n_experts'] has no expert count")
        return int(self.experts.max()) + 1

    def split(self, train_fraction: float = 0.5) -> tuple["Trace", "Trace"]:
        """First ``train_fraction`` of the tokens (in corpus order) and the rest: a held-out split that keeps
        contiguous text together, so the test half is not interleaved with the training half."""
        if not 0 < train_fraction < 1:
            raise MoEError(f"train_fraction must be in (0, 1), got {train_fraction}")
        n = int(len(self.experts) * train_fraction)
        return (Trace(self.experts[:n], dict(self.meta, split="train")),
                Trace(self.experts[n:], dict(self.meta, split="test")))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, experts=self.experts, meta=np.array(json.dumps(dict(self.meta, format=FORMAT))))
        return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """Raises MoEError when the file is not an hpdl trace."""
        import zipfile

        try:
            z = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            raise MoEError(f"path={path}: not an hpdl.moe trace .npz ({type(e).__name__}: {e})") from None
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise MoEError(f"path={path}: not an hpdl.moe trace (a single .npy array, not an .npz)")
        with z:
            if "experts" not in z or "meta" not in z:
                raise MoEError(f"path={path}: not an hpdl.moe trace (needs arrays 'experts' and 'meta')")
            try:
                meta = json.loads(str(z["meta"]))
            except (json.JSONDecodeError, ValueError) as e:
                raise MoEError(f"path={path}: meta is not JSON ({e})") from None
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
                raise MoEError(f"path={path}: format {got!r}, expected {FORMAT!r}")
            try:
                return cls(z["experts"], meta)
            except MoEError as e:
                raise MoEError(f"path={path}: {e}") from None


def data_identity(ids: np.ndarray, source: str) -> dict:
    """``{"source", "sha256", "n_tokens"}`` of a token array (any integer dtype; hashed as int32)."""
    a = np.ascontiguousarray(np.asarray(ids).astype(np.int32))
    return {"source": source, "sha256": hashlib.sha256(a.tobytes()).hexdigest()[:16], "n_tokens": int(a.size)}


def collect_trace(model, ids, source: str = "", batch_size: int = 8) -> Trace:
    """Run ``model`` (a :class:`hpdl.models.gpt_moe.MoEDecoder`) over ``ids [B, T]`` (int64 tensor or array,
    no padding) and record every token's top-k experts at every MoE layer, rows in ``(b, t)`` order.

    Returns a :class:`Trace` with ``N = B*T`` tokens.

    Raises:
        MoEError: ``ids`` not 2-D, or holding ids outside ``[0, vocab_size)``.
    """
    import torch

    from hpdl.models.gpt_moe import weights_identity

    ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    if ids_t.ndim != 2:
        raise MoEError(f"ids must be [batch, seq], got shape {tuple(ids_t.shape)}")
    V = model.cfg.vocab_size
    if ids_t.numel() and (int(ids_t.min()) < 0 or int(ids_t.max()) >= V):
        raise MoEError(f"ids must be token ids in [0, vocab_size={V}), got [{int(ids_t.min())}, {int(ids_t.max())}] "
                       f"(a trace of text tokenized for another model?)")
    out = []
    model.eval()
    with torch.no_grad():
        for b in range(0, len(ids_t), batch_size):
            _, _, experts = model(ids_t[b:b + batch_size], return_routing=True)
            out.append(torch.stack(experts, 1).numpy())  # [n, L, k]
    cfg = model.cfg
    meta = {"n_experts": cfg.n_experts, "top_k": cfg.top_k, "moe_layers": cfg.moe_layers,
            "model": {"arch": cfg.arch, "config": cfg.identity(), "weights": weights_identity(model)},
            "data": data_identity(ids_t.numpy(), source), "seq_len": int(ids_t.shape[1])}
    return Trace(np.concatenate(out, 0), meta)
