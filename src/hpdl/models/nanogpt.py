"""GPT-2 for training, in nanoGPT's one-readable-file manner (karpathy/nanoGPT model.py).

Config, LayerNorm with optional bias, causal self-attention, MLP, block, then the model, which returns
``(logits, loss)`` and owns its engineering facts: parameter count, FLOPs per token (PaLM, arXiv 2204.02311,
appendix B) and MFU, AdamW with weight decay on matrices only, and a copy from Hugging Face's
``GPT2LMHeadModel`` that checks every key and shape (the reference of the tests). Inference with a KV cache
and tensor parallelism live in :mod:`hpdl.models.gpt`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Architecture; the defaults are a small byte-level model that trains on CPUs (about 0.8 M parameters)."""

    block_size: int = 128     # context length (tokens)
    vocab_size: int = 256     # bytes; GPT-2's BPE would be 50304 (50257 padded to a multiple of 64)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True         # biases in Linear and LayerNorm, as GPT-2

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (torch's has no bias=False before 2.1)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one GEMM
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.dropout = cfg.n_head, cfg.dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # GPT-2's gelu_new


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(cfg.n_embd, cfg.bias), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = LayerNorm(cfg.n_embd, cfg.bias), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets)`` -> ``(logits, loss)``.

    ``idx`` and ``targets``: int64 ``[B, T]`` with ``T <= block_size``. With targets, logits are
    ``[B, T, vocab]`` and loss the mean cross-entropy over all ``B*T`` positions (float32 scalar); without,
    logits of the last position only, ``[B, 1, vocab]``, and loss None.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying (Press & Wolf, arXiv 1608.05859)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2 n_layer)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters; by default without the position embeddings (the token embedding is the tied head)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.cfg.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None  # (B, 1, vocab)
        logits = self.lm_head(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    def flops_per_token(self) -> float:
        """Training FLOPs per token, forward + backward: 6 N + 12 L T C (PaLM appendix B)."""
        c = self.cfg
        return 6 * self.num_params() + 12 * c.n_layer * c.block_size * c.n_embd

    def estimate_mfu(self, tokens_per_second: float, peak_flops: float) -> float:
        """Model FLOPs utilisation: achieved training FLOP/s over ``peak_flops`` (e.g. 989e12 for an H100's
        dense bf16, an H200's is the same)."""
        return self.flops_per_token() * tokens_per_second / peak_flops

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas=(0.9, 0.95),
                             device_type: str = "cpu") -> torch.optim.AdamW:
        """AdamW with weight decay on the matrices and embeddings (dim >= 2) only; fused on CUDA."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if fused else {}))

    @classmethod
    def from_hf_gpt2(cls, hf_model) -> "GPT":
        """Copy a ``transformers.GPT2LMHeadModel`` (GPT-2's Conv1D weights transposed), checking every key and
        shape. Raises ValueError on a missing, unexpected or mis-shaped tensor."""
        h = hf_model.config
        cfg = GPTConfig(block_size=h.n_positions, vocab_size=h.vocab_size, n_layer=h.n_layer, n_head=h.n_head,
                        n_embd=h.n_embd, bias=True)
        if (h.n_inner or 4 * h.n_embd) != 4 * h.n_embd or h.activation_function != "gelu_new":
            raise ValueError(f"only GPT-2's MLP is supported (n_inner=4*n_embd, gelu_new), got n_inner={h.n_inner} "
                             f"activation_function={h.activation_function!r}")
        model = cls(cfg)
        theirs = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items()
                  if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # causal-mask buffers
        ours = model.state_dict()
        theirs.setdefault("lm_head.weight", theirs.get("wte.weight"))
        missing = [k for k in ours if k not in theirs]
        extra = [k for k in theirs if k not in ours]
        if missing or extra:
            raise ValueError(f"GPT-2 state dict mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
        conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        with torch.no_grad():
            for k, p in ours.items():
                src = theirs[k].t() if k.endswith(conv1d) else theirs[k]
                if src.shape != p.shape:
                    raise ValueError(f"shape mismatch for {k}: checkpoint {tuple(src.shape)} vs model {tuple(p.shape)}")
                p.copy_(src)
        return model
