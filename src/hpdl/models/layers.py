"""Layers the decoders share (hpdl.models.gpt's dense LLaMA/GPT-2 and hpdl.models.gpt_moe's MoE decoder)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) as HF Llama computes it: normalised in float32, scaled by ``weight [dim]``,
    returned in the input's dtype. ``x [..., dim]``; ``eps`` inside the square root."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:  # half precision: torch's fused kernel (float32 inside), far fewer launches
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (half-split rotary embedding, as Llama and Mixtral)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (RoFormer, arXiv 2104.09864; half-split as HF Llama): ``x [..., heads, d]`` rotated by
    ``cos, sin`` broadcast to it (``[..., 1, d]``, in x's dtype, as HF computes it). The one RoPE of hpdl's
    decoders."""
    return x * cos + rotate_half(x) * sin
