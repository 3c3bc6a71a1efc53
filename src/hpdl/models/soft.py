"""SOFT: softmax-free vision transformers with linear-complexity Gaussian-kernel attention.

Lu et al., "SOFT: Softmax-free Transformer with Linear Complexity", NeurIPS 2021 (arXiv 2110.11945); SOFT++
("Softmax-free Linear Transformers", IJCV 2024, arXiv 2207.03341) adds symmetric normalisation. The layout
follows the official code (github.com/fudan-zvg/SOFT, ``models/softmax_free_vision_transformer.py``), so its
checkpoints load through :func:`convert_official_state_dict`:

    stem (3x3 conv+BN+ReLU: s2 -> s1 -> s2) -> stage 1 (H/4)  SOFT blocks, landmarks by 8x8 stride-8 conv
    3x3 s2 conv+BN+ReLU                     -> stage 2 (H/8)  SOFT blocks, 4x4 landmarks
    3x3 s2 conv+BN+ReLU                     -> stage 3 (H/16) SOFT blocks, 2x2 landmarks
    3x3 s2 conv+BN+ReLU, + cls token        -> stage 4 (H/32) softmax attention blocks (PVT style, pre-LN)
    LayerNorm -> Linear head on the cls token

A SOFT block is post-LN: ``x = LN(x + attn(x)); x = LN(x + FFN(x))`` with a 4x tanh-GELU FFN; the attention has
only W_q and W_v (keys are tied to queries), a depthwise conv on V (9/5/3 per stage, one kernel per head) and an
output Linear. At 224x224 every SOFT stage has 7x7 = 49 landmarks. Models: soft_tiny ... soft_huge (SOFT) and
soft_norm_tiny ... soft_norm_huge (SOFT++); with timm installed, importing this module registers them, so
``timm.create_model("soft_tiny")`` works.

    from hpdl.models.soft import soft_tiny
    model = soft_tiny(num_classes=1000)          # [B, 3, 224, 224] ImageNet-normalised -> [B, 1000] logits
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from hpdl.models.soft_kernels import PRECISIONS
from hpdl.models.soft_ops import IMPLS, NR_BACKWARDS, NR_STARTS, soft_attention

__all__ = ["MODEL_CONFIGS", "PAPER_PARAMS_M", "SoftAttention", "SoftConfig", "SoftViT",
           "convert_official_state_dict", "create", "from_official", "soft_huge", "soft_large", "soft_medium",
           "soft_norm_huge", "soft_norm_large", "soft_norm_medium", "soft_norm_small", "soft_norm_tiny",
           "soft_small", "soft_tiny"]


@dataclass
class SoftConfig:
    """Architecture of a SOFT model (defaults: SOFT-Tiny at 224x224, ImageNet-1K)."""

    img_size: int = 224  # positional embeddings are sized for it and resized bilinearly for other inputs
    in_chans: int = 3
    num_classes: int = 1000
    embed_dims: tuple[int, ...] = (64, 128, 320, 512)
    num_heads: tuple[int, ...] = (2, 4, 10, 16)
    depths: tuple[int, ...] = (1, 2, 3, 2)
    sr_ratios: tuple[int, ...] = (8, 4, 2)  # landmark conv kernel = stride, stages 1-3
    conv_sizes: tuple[int, ...] = (9, 5, 3)  # depthwise conv on V, stages 1-3 (0: none)
    mlp_ratio: float = 4.0  # every FFN (the official SOFT blocks hard-code 4; stage 4 reads mlp_ratios[3] = 4)
    stem_channels: int = 32
    variant: str = "soft"  # "soft" or "norm" (SOFT++)
    landmark: str = "conv"  # "conv" (strided conv + LN + GELU, the paper's) or "pool" (average pooling, no weights)
    attention: str = "soft"  # "soft", or "sdpa": softmax attention over the same tied Q/K (a baseline)
    nr_iters: int = 20
    nr_reg: float = 0.01
    nr_backward: str = "inverse"  # the paper's -V^T G V^T; "exact" differentiates the truncated iteration
    nr_start: str | None = None  # None: "identity" (V0 = I/(s+reg)) for SOFT, "official" for SOFT++
    impl: str = "auto"  # "auto": Triton kernels on CUDA, torch elsewhere; "torch"; "triton"
    precision: str = "tf32"  # Triton landmark products: "tf32", "tf32x3" or "ieee"
    nr_precision: str | None = None  # Triton Newton products above 64 landmarks; None: "tf32x3" (see soft_kernels)
    nr_tol: float | None = None  # Triton Newton early exit; None: soft_kernels.NR_TOL, 0: all nr_iters steps
    drop_rate: float = 0.0
    drop_path_rate: float = 0.0

    def __post_init__(self):
        for name in ("embed_dims", "num_heads", "depths", "sr_ratios", "conv_sizes"):
            setattr(self, name, tuple(getattr(self, name)))
        n = len(self.embed_dims)
        if n != 4 or len(self.num_heads) != 4 or len(self.depths) != 4:
            raise ValueError(f"embed_dims, num_heads and depths need 4 stages, got {self.embed_dims}, "
                             f"{self.num_heads}, {self.depths}")
        if len(self.sr_ratios) != 3 or len(self.conv_sizes) != 3:
            raise ValueError(f"sr_ratios and conv_sizes need 3 SOFT stages, got {self.sr_ratios}, {self.conv_sizes}")
        bad = [(d, h) for d, h in zip(self.embed_dims, self.num_heads) if d % h]
        if bad:
            raise ValueError(f"embed_dims must be multiples of num_heads, got {bad}")
        for name, value, allowed in (("variant", self.variant, ("soft", "norm")),
                                     ("landmark", self.landmark, ("conv", "pool")),
                                     ("attention", self.attention, ("soft", "sdpa")),
                                     ("nr_backward", self.nr_backward, NR_BACKWARDS),
                                     ("nr_start", self.nr_start, (None,) + NR_STARTS),
                                     ("impl", self.impl, IMPLS), ("precision", self.precision, PRECISIONS),
                                     ("nr_precision", self.nr_precision, (None,) + PRECISIONS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if self.img_size < 32 or self.img_size % 32:
            raise ValueError(f"img_size must be a multiple of 32 (>= 32), got {self.img_size}")
        for name in ("embed_dims", "num_heads", "depths", "sr_ratios"):
            if min(getattr(self, name)) < 1:
                raise ValueError(f"{name} must all be >= 1, got {getattr(self, name)}")
        if any(k < 0 or (k and k % 2 == 0) for k in self.conv_sizes):
            raise ValueError(f"conv_sizes must be odd (same-size output) or 0 (no conv), got {self.conv_sizes}")
        for i, r in enumerate(self.sr_ratios):  # at least one landmark per stage at img_size
            if (self.img_size // 4) >> i < r:
                raise ValueError(f"sr_ratios[{i}]={r} exceeds stage {i + 1}'s {(self.img_size // 4) >> i}-token side "
                                 f"at img_size={self.img_size}: zero landmarks")
        if self.num_classes < 0:
            raise ValueError(f"num_classes must be >= 0 (0: no head), got {self.num_classes}")
        if self.in_chans < 1 or self.stem_channels < 0 or not self.mlp_ratio > 0:
            raise ValueError(f"in_chans >= 1, stem_channels >= 0 and mlp_ratio > 0 needed, got {self.in_chans}, "
                             f"{self.stem_channels}, {self.mlp_ratio}")
        if self.nr_iters < 0:
            raise ValueError(f"nr_iters must be >= 0, got {self.nr_iters}")
        if not self.nr_reg >= 0:
            raise ValueError(f"nr_reg must be >= 0, got {self.nr_reg}")
        if self.nr_tol is not None and not self.nr_tol >= 0:
            raise ValueError(f"nr_tol must be None or >= 0, got {self.nr_tol}")
        if self.nr_start == "identity" and not (self.variant == "soft" and self.nr_reg > 0):
            raise ValueError(f"nr_start='identity' needs variant='soft' and nr_reg > 0, got {self.variant!r}, "
                             f"{self.nr_reg}")
        for name in ("drop_rate", "drop_path_rate"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


# name -> overrides of SoftConfig (official zoo; embed [64,128,C3,512], heads [2,4,h3,16], head_dim 32)
MODEL_CONFIGS: dict[str, dict] = {
    "soft_tiny": dict(depths=(1, 2, 3, 2)),
    # The official soft_small factory builds (1, 3, 20, 4): 38.9M parameters, not the table's 24M / 3.3G; (1, 3, 7, 4)
    # gives 24.1M and 3.7 GMACs (the same measured-to-paper FLOPs ratio as Tiny), so that is the table's model.
    "soft_small": dict(depths=(1, 3, 7, 4)),
    "soft_medium": dict(depths=(1, 3, 29, 5), embed_dims=(64, 128, 288, 512), num_heads=(2, 4, 9, 16)),
    "soft_large": dict(depths=(1, 3, 40, 5)),
    "soft_huge": dict(depths=(1, 5, 49, 5), embed_dims=(64, 128, 352, 512), num_heads=(2, 4, 11, 16)),
}
MODEL_CONFIGS.update({"soft_norm_" + k[5:]: dict(v, variant="norm") for k, v in list(MODEL_CONFIGS.items())})
# parameter counts of the paper's table (ImageNet-1K head), millions
PAPER_PARAMS_M = {"tiny": 13, "small": 24, "medium": 45, "large": 64, "huge": 87}


class SoftAttention(nn.Module):
    """SOFT self-attention over an ``H x W`` token map: ``[B, N, C] -> [B, N, C]``, N = H*W.

    Queries and keys are tied (only ``W_q`` and ``W_v``), scaled by ``head_dim**-0.25``, so the kernel is
    ``exp(-||q_i - q_j||^2 / (2 sqrt(d)))``. Landmarks: the per-head query map goes through a
    ``sr_ratio x sr_ratio`` stride-``sr_ratio`` conv (shared by heads) + LayerNorm + GELU (``landmark="conv"``) or
    an average pool of the same window (``"pool"``; ``sr_ratio=1`` then makes the landmarks the tokens, i.e. exact
    kernel attention). Then :func:`hpdl.models.soft_ops.soft_attention`, plus a depthwise ``conv_size`` conv on V.
    Parameter names follow the official code.

    Raises:
        ValueError: an argument is out of range, or (forward) the token map is smaller than ``sr_ratio``.
    """

    def __init__(self, dim: int, num_heads: int, sr_ratio: int, conv_size: int = 3, *, variant: str = "soft",
                 landmark: str = "conv", attention: str = "soft", nr_iters: int = 20, nr_reg: float = 0.01,
                 nr_backward: str = "inverse", nr_start: str | None = None, impl: str = "auto",
                 precision: str = "tf32", nr_precision: str | None = None, nr_tol: float | None = None):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be a multiple of num_heads ({num_heads})")
        if sr_ratio < 1:
            raise ValueError(f"sr_ratio must be >= 1, got {sr_ratio}")
        if conv_size < 0 or (conv_size and conv_size % 2 == 0):
            raise ValueError(f"conv_size must be odd (same-size output) or 0, got {conv_size}")
        if nr_reg < 0 or nr_iters < 0:
            raise ValueError(f"nr_reg and nr_iters must be >= 0, got {nr_reg}, {nr_iters}")
        if nr_tol is not None and not nr_tol >= 0:
            raise ValueError(f"nr_tol must be None or >= 0, got {nr_tol}")
        self.num_heads, self.head_dim, self.sr_ratio = num_heads, dim // num_heads, sr_ratio
        self.variant, self.landmark, self.attention = variant, landmark, attention
        self.nr_iters, self.nr_reg, self.nr_backward = nr_iters, nr_reg, nr_backward
        self.nr_start, self.impl, self.precision, self.nr_precision = nr_start, impl, precision, nr_precision
        self.nr_tol = nr_tol  # None: soft_kernels.NR_TOL (Triton Newton early exit); 0: all nr_iters steps
        self.W_q = nn.Linear(dim, dim)
        self.W_v = nn.Linear(dim, dim)
        if attention == "soft" and landmark == "conv":
            hd = self.head_dim
            self.Qlandmark_op = nn.Conv2d(hd, hd, kernel_size=sr_ratio, stride=sr_ratio, bias=False)
            self.Qnorm_act = nn.Sequential(nn.LayerNorm(hd), nn.GELU())
        self.conv = (nn.Conv2d(num_heads, num_heads, conv_size, padding=conv_size // 2, groups=num_heads, bias=False)
                     if conv_size else None)
        self.ff = nn.Linear(dim, dim)

    def landmarks(self, q: torch.Tensor, H: int, W: int) -> torch.Tensor:
        """``q [B, h, N, d]`` (scaled) -> landmarks ``[B, h, m, d]``, m = (H // sr) * (W // sr)."""
        b, h, n, d = q.shape
        r = self.sr_ratio
        if H < r or W < r:
            raise ValueError(f"token map {H}x{W} is smaller than sr_ratio={r}: use a larger input image")
        x = q.reshape(b * h, H, W, d).permute(0, 3, 1, 2)  # [B*h, d, H, W]
        x = self.Qlandmark_op(x) if self.landmark == "conv" else F.avg_pool2d(x, r, r)
        x = x.flatten(2).transpose(1, 2).reshape(b, h, -1, d)
        return self.Qnorm_act(x) if self.landmark == "conv" else x

    def forward(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
        b, n, c = x.shape
        if n != H * W:
            raise ValueError(f"x has {n} tokens, expected H*W = {H}*{W}")
        h, d = self.num_heads, self.head_dim
        q = self.W_q(x).view(b, n, h, d).transpose(1, 2)  # [B, h, N, d]
        v = self.W_v(x).view(b, n, h, d).transpose(1, 2)
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, q, v)
        else:
            q = q * d ** -0.25
            out = soft_attention(q, v, self.landmarks(q, H, W), variant=self.variant, iters=self.nr_iters,
                                 reg=self.nr_reg, backward=self.nr_backward, start=self.nr_start,
                                 impl=self.impl, precision=self.precision, nr_precision=self.nr_precision,
                                 **({} if self.nr_tol is None else {"nr_tol": self.nr_tol}))
        if self.conv is not None:  # one k x k kernel per head, shared by its d channels
            vmap = v.transpose(-1, -2).reshape(b, c, H, W)  # channel = head * d + j
            w = self.conv.weight.repeat_interleave(d, dim=0)
            local = F.conv2d(vmap, w, padding=self.conv.padding, groups=c)
            out = out + local.view(b, h, d, n).transpose(-1, -2)
        return self.ff(out.transpose(1, 2).reshape(b, n, c))


class SoftBlock(nn.Module):
    """Post-LN SOFT block: ``x = LN(x + attn(x)); x = LN(x + FFN(x))``, tanh-GELU FFN (official: dropout as
    "drop path")."""

    def __init__(self, dim: int, num_heads: int, sr_ratio: int, conv_size: int, cfg: SoftConfig, drop: float):
        super().__init__()
        self.mha = SoftAttention(dim, num_heads, sr_ratio, conv_size, variant=cfg.variant, landmark=cfg.landmark,
                                 attention=cfg.attention, nr_iters=cfg.nr_iters, nr_reg=cfg.nr_reg,
                                 nr_backward=cfg.nr_backward, nr_start=cfg.nr_start, impl=cfg.impl,
                                 precision=cfg.precision, nr_precision=cfg.nr_precision, nr_tol=cfg.nr_tol)
        self.dropout1 = nn.Dropout(drop)
        self.norm1 = nn.LayerNorm(dim)
        hidden = int(dim * cfg.mlp_ratio)
        self.ff1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.ff2 = nn.Linear(hidden, dim)
        self.dropout2 = nn.Dropout(drop)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
        x = self.norm1(x + self.dropout1(self.mha(x, H, W)))
        return self.norm2(x + self.dropout2(self.ff2(self.act(self.ff1(x)))))


class Attention(nn.Module):
    """Softmax multi-head self-attention of stage 4 (PVT's, spatial reduction 1), through SDPA."""

    def __init__(self, dim: int, num_heads: int, drop: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        h = self.num_heads
        q = self.q(x).view(b, n, h, c // h).transpose(1, 2)  # [B, h, N, d]
        k, v = self.kv(x).view(b, n, 2, h, c // h).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(out))


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth (Huang et al. 2016): zero whole samples with probability p, rescale the rest.

    Raises ValueError unless 0 <= p < 1 (p = 1 would divide by zero)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"drop path probability p must be in [0, 1), got {p}")
    if p == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1 - p)
    return x * keep / (1 - p)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Block(nn.Module):
    """Pre-LN softmax-attention block of stage 4."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, drop: float, drop_path_p: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, drop)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop)
        self.drop_path_p = drop_path_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + drop_path(self.attn(self.norm1(x)), self.drop_path_p, self.training)
        return x + drop_path(self.mlp(self.norm2(x)), self.drop_path_p, self.training)


class PatchEmbed(nn.Module):
    """Stride-4 stem (3 convs) for stage 1, one stride-2 3x3 conv+BN+ReLU for stages 2-4: ``[B,C,H,W] -> [B,N,C']``."""

    def __init__(self, in_chans: int, embed_dim: int, stem_channels: int | None = None):
        super().__init__()

        def cbr(i, o, s):
            return [nn.Conv2d(i, o, 3, stride=s, padding=1), nn.BatchNorm2d(o), nn.ReLU()]

        if stem_channels:
            layers = cbr(in_chans, stem_channels, 2) + cbr(stem_channels, stem_channels, 1) + cbr(stem_channels,
                                                                                                 embed_dim, 2)
        else:
            layers = cbr(in_chans, embed_dim, 2)
        self.proj = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        x = self.proj(x)
        H, W = x.shape[2:]
        return x.flatten(2).transpose(1, 2), H, W


def _resize_pos(pos: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """``[1, S*S, C]`` positional embedding -> ``[1, H*W, C]`` (bilinear, as the official code)."""
    side = math.isqrt(pos.shape[1])
    if (side, side) == (H, W):
        return pos
    grid = pos.reshape(1, side, side, -1).permute(0, 3, 1, 2)
    return F.interpolate(grid, size=(H, W), mode="bilinear", align_corners=False).flatten(2).transpose(1, 2)


class SoftViT(nn.Module):
    """SOFT classifier: ``[B, in_chans, H, W]`` (H, W multiples of 32) -> ``[B, num_classes]`` logits."""

    def __init__(self, cfg: SoftConfig | None = None, **overrides):
        super().__init__()
        cfg = replace(cfg or SoftConfig(), **overrides) if overrides else (cfg or SoftConfig())
        self.cfg = cfg
        self.num_classes = cfg.num_classes
        self.num_features = self.head_hidden_size = cfg.embed_dims[3]   # timm's names for the pooled width
        self.global_pool = "token"
        # timm reads this (e.g. timm.data.resolve_model_data_config): the input this model was built for
        self.pretrained_cfg = {"input_size": (cfg.in_chans, cfg.img_size, cfg.img_size), "num_classes": cfg.num_classes,
                               "interpolation": "bicubic", "crop_pct": 0.875, "crop_mode": "center",
                               "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225),
                               "first_conv": "patch_embed1.proj.0", "classifier": "head"}
        self.default_cfg = self.pretrained_cfg
        dims, heads, depths = cfg.embed_dims, cfg.num_heads, cfg.depths
        total = sum(depths)
        dpr = [cfg.drop_path_rate * i / max(total - 1, 1) for i in range(total)]  # stochastic depth decay rule
        side = cfg.img_size // 4
        cur = 0
        for i in range(4):
            embed = PatchEmbed(cfg.in_chans if i == 0 else dims[i - 1], dims[i], cfg.stem_channels if i == 0 else None)
            setattr(self, f"patch_embed{i + 1}", embed)
            tokens = (side >> i) ** 2 + (i == 3)  # stage 4 carries the cls token
            setattr(self, f"pos_embed{i + 1}", nn.Parameter(torch.zeros(1, tokens, dims[i])))
            if i < 3:  # the official stage 4 has no dropout after its position embedding
                setattr(self, f"pos_drop{i + 1}", nn.Dropout(cfg.drop_rate))
            if i < 3:
                blocks = [SoftBlock(dims[i], heads[i], cfg.sr_ratios[i], cfg.conv_sizes[i], cfg, dpr[cur + j])
                          for j in range(depths[i])]
            else:
                blocks = [Block(dims[i], heads[i], cfg.mlp_ratio, cfg.drop_rate, dpr[cur + j])
                          for j in range(depths[i])]
            setattr(self, f"block{i + 1}", nn.ModuleList(blocks))
            cur += depths[i]
        self.norm = nn.LayerNorm(dims[3], eps=1e-6)
        self.grad_checkpointing = False
        # timm's feature metadata: one entry per stage output (forward_intermediates, features_only=True)
        self.feature_info = [dict(num_chs=dims[i], reduction=4 * 2 ** i, module=f"block{i + 1}") for i in range(4)]
        self.register_load_state_dict_pre_hook(self._resample_pos_embed)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dims[3]))
        self.head = nn.Linear(dims[3], cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        for i in range(4):
            nn.init.trunc_normal_(getattr(self, f"pos_embed{i + 1}"), std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def no_weight_decay(self) -> set[str]:
        """Parameter names kept out of weight decay (timm's optimizer factory reads this; official: cls_token)."""
        return {"cls_token"}

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != self.cfg.in_chans:
            raise ValueError(f"x must be [B, {self.cfg.in_chans}, H, W], got shape {tuple(x.shape)}")
        if x.shape[0] == 0:
            raise ValueError("x holds no images (batch size 0)")
        if x.shape[2] % 32 or x.shape[3] % 32:
            raise ValueError(f"x's height and width must be multiples of 32 (the four stages halve them 5 times), "
                             f"got {tuple(x.shape[2:])}")
        ref = self.patch_embed1.proj[0].weight
        if x.dtype != ref.dtype and not torch.is_autocast_enabled(x.device.type):
            raise ValueError(f"x is {x.dtype} but the model's parameters are {ref.dtype}: convert one of them or "
                             f"run under torch.autocast")

    def _stages(self, x: torch.Tensor, take: set[int], stop: int, norm: bool) -> list:
        """Stages 0..stop; (stage index, NCHW map, final tokens or None) after each stage in ``take``."""
        b, out = x.shape[0], []
        for i in range(min(stop, 2) + 1):
            x, H, W = getattr(self, f"patch_embed{i + 1}")(x)
            x = getattr(self, f"pos_drop{i + 1}")(x + _resize_pos(getattr(self, f"pos_embed{i + 1}"), H, W))
            for blk in getattr(self, f"block{i + 1}"):
                if self.grad_checkpointing and torch.is_grad_enabled():
                    x = torch.utils.checkpoint.checkpoint(blk, x, H, W, use_reentrant=False)
                else:
                    x = blk(x, H, W)
            x = x.transpose(1, 2).reshape(b, -1, H, W)
            if i in take:
                out.append((i, x, None))
        if stop < 3:
            return out
        x, H, W = self.patch_embed4(x)
        pos = self.pos_embed4
        pos = torch.cat([pos[:, :1], _resize_pos(pos[:, 1:], H, W)], dim=1)
        x = torch.cat([self.cls_token.expand(b, -1, -1), x], dim=1) + pos
        for blk in self.block4:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        tokens = self.norm(x)
        fmap = (tokens if norm else x)[:, 1:].transpose(1, 2).reshape(b, -1, H, W)
        out.append((3, fmap, tokens))
        return out

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W] -> [B, 1 + N4, C4]``: stage 4's tokens (cls first) after the final LayerNorm, unpooled,
        as timm's ``forward_features``; :meth:`forward_head` pools them (N4 = H/32 * W/32).

        Raises:
            ValueError: x is not ``[B>0, in_chans, H, W]`` with H, W multiples of 32, or its dtype differs from
                the parameters' outside autocast.
        """
        self._check_input(x)
        return self._stages(x, {3}, 3, False)[-1][2]

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False):
        """timm's ``forward_intermediates``: stage outputs ``[B, C_i, H/2^(i+2), W/2^(i+2)]`` (NCHW; stage 4
        without its cls token, after the final LayerNorm if ``norm``). ``indices``: the last n stages (int), the
        listed ones, or all (None). Returns the list, or ``(forward_features(x), list)``."""
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt must be 'NCHW', got {output_fmt!r}")
        if indices is None:
            take = [0, 1, 2, 3]
        elif isinstance(indices, int):
            if not 1 <= indices <= 4:
                raise ValueError(f"indices (an int: the last n stages) must be in 1..4, got {indices}")
            take = list(range(4 - indices, 4))
        else:
            take = [i % 4 for i in indices]
            if any(not -4 <= i < 4 for i in indices):
                raise ValueError(f"indices must be stage numbers in -4..3, got {indices}")
        self._check_input(x)
        stop = max(take) if stop_early or intermediates_only else 3
        out = self._stages(x, set(take) | {stop}, stop, norm)
        inter = [fmap for i, fmap, _ in out if i in take]
        if intermediates_only:
            return inter
        return out[-1][2], inter

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in the backward instead of storing its activations (timm's method)."""
        self.grad_checkpointing = enable

    def group_matcher(self, coarse: bool = False) -> dict:
        """timm's parameter groups (layer-wise lr decay): the stem and embeddings, then each block (or stage)."""
        return dict(stem=r"^cls_token|^pos_embed|^patch_embed1",
                    blocks=r"^block(\d+)|^patch_embed(\d+)" if coarse else
                    [(r"^block(\d+)\.(\d+)", None), (r"^patch_embed(\d+)", (0,)), (r"^norm", (99999,))])

    def _resample_pos_embed(self, module, state_dict, prefix, *args) -> None:
        """Load-time hook: position embeddings of another image size are resized bilinearly to this model's
        (stage 4 keeps its cls entry), so a 224 px checkpoint loads into a model built for 384 px."""
        for i in range(4):
            key = f"{prefix}pos_embed{i + 1}"
            own = getattr(self, f"pos_embed{i + 1}")
            got = state_dict.get(key)
            if got is None or got.shape == own.shape or got.dim() != 3 or got.shape[-1] != own.shape[-1]:
                continue
            side = math.isqrt(own.shape[1] - (i == 3))
            if i == 3:
                state_dict[key] = torch.cat([got[:, :1], _resize_pos(got[:, 1:], side, side)], dim=1)
            else:
                state_dict[key] = _resize_pos(got, side, side)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """timm's ``forward_head``: tokens ``[B, 1 + N4, C4]`` -> logits ``[B, num_classes]`` (the cls token, or the
        mean of the other tokens with ``global_pool="avg"``); ``pre_logits=True`` returns the pooled ``[B, C4]``."""
        x = x[:, 1:].mean(1) if self.global_pool == "avg" else x[:, 0]
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new head for ``num_classes`` (0: none, the model returns pooled features), timm's signature;
        ``global_pool`` ``"token"`` (cls token, the official model's) or ``"avg"``; None keeps the current one.
        The new head is created on the old one's device and dtype."""
        if global_pool is not None:
            if global_pool not in ("token", "avg"):
                raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
            self.global_pool = global_pool
        ref = self.norm.weight
        self.num_classes = num_classes
        self.head = (nn.Linear(self.num_features, num_classes, device=ref.device, dtype=ref.dtype)
                     if num_classes > 0 else nn.Identity())

    def num_params(self) -> int:
        """Number of parameters."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def flops(self, img_size: int | None = None) -> int:
        """FLOPs (2 per multiply-add, matmuls and convs, as ``torch.utils.flop_counter`` counts) of one forward of
        one image; vision papers' "FLOPs" usually count multiply-adds, i.e. half of this."""
        from torch.utils.flop_counter import FlopCounterMode

        size = img_size or self.cfg.img_size
        p = next(self.parameters())
        x = torch.zeros(1, self.cfg.in_chans, size, size, device=p.device, dtype=p.dtype)
        was = self.training
        self.eval()
        with FlopCounterMode(display=False) as counter:
            self(x)
        self.train(was)
        return counter.get_total_flops()


def convert_official_state_dict(state_dict: dict) -> dict:
    """Rename an official fudan-zvg/SOFT checkpoint's keys to this module's (``block1.0.att.mha.attn.conv.weight``
    -> ``block1.0.mha.conv.weight``, ``block1.0.att.norm1`` -> ``block1.0.norm1``); a ``"model"`` entry (the
    official training script's checkpoint) is unwrapped. Load the result with ``load_state_dict(strict=True)``."""
    sd = state_dict.get("model", state_dict)
    out = {}
    for key, value in sd.items():
        key = re.sub(r"^(block[123]\.\d+)\.att\.mha\.attn\.", r"\1.mha.", key)
        key = re.sub(r"^(block[123]\.\d+)\.att\.", r"\1.", key)
        out[key] = value
    return out


def from_official(state_dict: dict, variant: str = "soft", **overrides) -> SoftViT:
    """Build the model an official fudan-zvg/SOFT checkpoint describes and load it (strict).

    Depths, widths, head counts (head_dim from the landmark conv; stage 4's heads take head_dim 32 as every
    official config), landmark strides, V-conv sizes, stem width, MLP ratio, classes and the training image size
    are read from the tensors, so e.g. the official SOFT-Small (depths 1, 3, 20, 4) loads although
    ``soft_small`` here is the paper table's (1, 3, 7, 4). ``variant`` ("soft" or "norm") is not in the weights;
    ``overrides`` set other :class:`SoftConfig` fields (an ``img_size`` other than the checkpoint's resizes the
    position embeddings on load). The Newton start is the official one (``nr_start="official"``): the checkpoint
    was trained through that truncated iteration, and its landmark kernels are ill-conditioned enough (cond
    ~1e3 at the official init) for the identity start's better-converged inverse to differ by ~2e-4.

    Raises:
        ValueError: the state dict is not a SOFT checkpoint (a key this builder needs is missing).
        RuntimeError: from ``load_state_dict`` if tensors still disagree.
    """
    sd = convert_official_state_dict(state_dict)
    need = [f"pos_embed{i}" for i in range(1, 5)] + ["patch_embed1.proj.0.weight", "head.weight"]
    missing = [k for k in need if k not in sd]
    if missing:
        raise ValueError(f"state_dict is not a SOFT checkpoint: missing {missing}")
    depths = tuple(1 + max((int(m.group(1)) for k in sd if (m := re.match(rf"^block{i}\.(\d+)\.", k))), default=-1)
                   for i in range(1, 5))
    dims = tuple(sd[f"pos_embed{i}"].shape[-1] for i in range(1, 5))
    heads, srs, convs = [], [], []
    for i in range(1, 4):
        lm = sd.get(f"block{i}.0.mha.Qlandmark_op.weight")
        hd = lm.shape[0] if lm is not None else 32
        heads.append(dims[i - 1] // hd)
        srs.append(lm.shape[-1] if lm is not None else SoftConfig.sr_ratios[i - 1])
        conv = sd.get(f"block{i}.0.mha.conv.weight")
        convs.append(conv.shape[-1] if conv is not None else 0)
    heads.append(dims[3] // 32)
    side = math.isqrt(sd["pos_embed1"].shape[1])
    ff1 = sd.get("block1.0.ff1.weight")
    cfg = dict(embed_dims=dims, num_heads=tuple(heads), depths=depths, sr_ratios=tuple(srs), conv_sizes=tuple(convs),
               stem_channels=sd["patch_embed1.proj.0.weight"].shape[0], num_classes=sd["head.weight"].shape[0],
               img_size=side * 4, variant=variant, nr_start="official",
               mlp_ratio=ff1.shape[0] / ff1.shape[1] if ff1 is not None else 4.0)
    cfg.update(overrides)
    model = SoftViT(SoftConfig(**cfg))
    model.load_state_dict(sd, strict=True)
    return model


_TIMM_KWARGS = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir", "device", "dtype")


def create(name: str, pretrained: bool = False, **kwargs) -> SoftViT:
    """Build a SOFT model by name (``MODEL_CONFIGS``); ``kwargs`` override :class:`SoftConfig` fields.

    Raises:
        ValueError: unknown name or field, or ``pretrained=True`` (no weights ship with hpdl: load an official
            checkpoint with :func:`convert_official_state_dict`).
    """
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown SOFT model {name!r}; expected one of {sorted(MODEL_CONFIGS)}")
    if pretrained:
        raise ValueError("pretrained=True: hpdl ships no SOFT weights; load an official checkpoint with "
                         "model.load_state_dict(convert_official_state_dict(torch.load(path)))")
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    global_pool = kwargs.pop("global_pool", None)   # timm's model argument: "token" (default) or "avg"
    features_only = kwargs.pop("features_only", False)   # timm's: a backbone returning stage maps
    out_indices = kwargs.pop("out_indices", (0, 1, 2, 3))
    for k in _TIMM_KWARGS:
        kwargs.pop(k, None)
    fields = set(SoftConfig.__dataclass_fields__)
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(f"unknown SoftConfig fields {unknown}; expected some of {sorted(fields)}")
    model = SoftViT(SoftConfig(**{**MODEL_CONFIGS[name], **kwargs}))
    if global_pool is not None:
        model.reset_classifier(model.num_classes, global_pool)
    if features_only:
        from timm.models._features import FeatureGetterNet

        model.reset_classifier(0)
        model = FeatureGetterNet(model, out_indices=list(out_indices), output_fmt="NCHW", prune=False)
    return model.to(device=device, dtype=dtype) if device is not None or dtype is not None else model


def _factory(name: str):
    def fn(pretrained: bool = False, **kwargs) -> SoftViT:
        return create(name, pretrained, **kwargs)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"{name}: SOFT{'++' if 'norm' in name else ''} model, config {MODEL_CONFIGS[name]}."
    return fn


soft_tiny = _factory("soft_tiny")
soft_small = _factory("soft_small")
soft_medium = _factory("soft_medium")
soft_large = _factory("soft_large")
soft_huge = _factory("soft_huge")
soft_norm_tiny = _factory("soft_norm_tiny")
soft_norm_small = _factory("soft_norm_small")
soft_norm_medium = _factory("soft_norm_medium")
soft_norm_large = _factory("soft_norm_large")
soft_norm_huge = _factory("soft_norm_huge")

try:  # timm's registry, so timm.create_model("soft_tiny") works once this module is imported
    from timm.models import register_model as _register
except ImportError:  # timm is optional (the vision extra)
    _register = None
if _register is not None:
    for _name in MODEL_CONFIGS:
        _register(globals()[_name])
