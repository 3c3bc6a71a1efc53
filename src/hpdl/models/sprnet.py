"""SPRNet: one-stage instance segmentation by single-pixel reconstruction, on torchvision's RetinaNet.

J. Yu, J. Yao, J. Zhang, Z. Yu, D. Tao, "SPRNet: Single-Pixel Reconstruction for One-Stage Instance
Segmentation", IEEE Trans. Cybernetics 51(4), 2021 (arXiv 1904.07426). No public code exists; this follows the
paper as summarised in docs/vision.md, and says where it had to choose.

RetinaNet (ResNet-FPN, P3-P7, 9 anchors a location, focal loss and L1 box loss as torchvision has them) gets a
third, parallel branch, the single-pixel reconstruction (SPR) branch:

- Mask enhancement on each pyramid level (shared across levels): a 1x1 conv (256 ch) beside three 3x3 convs
  dilated 2/4/6 (128 ch each), concatenated and ReLU'd: one 640-d vector per pixel.
- SPR decoder: a pixel's vector alone -> a 1x1 conv -> three deconvolutions without activation (1 -> 8x8) ->
  two deconvolutions with ReLU (-> 32x32), plus a nearest-upsampled shortcut from 8x8; one 32x32 mask logit
  map per class (on-class binary cross-entropy, as Mask R-CNN). In the paper the target is the ground-truth
  mask cropped to its box, and inference pastes the mask into the detection's regressed box, so every
  imperfect box distorts its mask (``mask_frame="gt"``, ``mask_margin=1.0`` keep that).
- Positive pixels: a pixel is positive when any of its 9 anchors has IoU > 0.7 with a ground-truth box, and that
  anchor's best box picks the instance; at most 300 positive pixels an image are sampled.
- Gated FPN (GFPN): the top-down sum ``y = x1 + x2`` becomes ``y = x1 * sigmoid(g(x1)) + x2 * sigmoid(g(x2))``
  with ``g`` one depthwise-separable 3x3 conv shared by all inputs. ``fpn="sum"`` keeps torchvision's FPN.
- Total loss: classification + box regression + mask, unweighted.

Changes for Mask R-CNN's mask AP (issue 35; each a config field, docs/vision.md gives the reasons): one mask
frame for training and inference, the anchor's decoded box (detached) enlarged ``mask_margin`` (1.2x) for the
target and the same enlargement of the detected box for the paste; positives are anchors (IoU > 0.5, the
pixel's vector, the anchor's frame); the decoder scales and shifts the reduced vector per anchor and has a 3x3
conv after each upsampling (``decoder_convs``). Second session: the decoder is also told its frame (the box's
deltas from the anchor scale and shift the reduced vector, ``frame_conditioning``) and starts from a
variance-preserving init (``decoder_init``). One feature vector still gives one mask.

Our choices where the paper is silent or unverified (docs/vision.md lists them): every instance also keeps
its best anchor (as torchvision's low-quality matches), so an instance that no anchor covers at IoU
0.7 still trains the mask; the enhancement convs read the FPN features directly, so a pixel's vector depends on
a 13x13 window only and is computed for the selected pixels alone (``conv_at``: the same numbers as the dense
conv, no dense mask tensor ever); gate init is PyTorch's default.

Shapes (torchvision's detection API): inputs a list of float [3, H, W] in 0-1; training targets ``boxes``
float [N, 4] (x1, y1, x2, y2), ``labels`` int64 [N] in 1..K, ``masks`` uint8 [N, H, W]; training returns
``{"classification", "bbox_regression", "mask"}`` scalar losses; inference returns per image ``boxes`` [D, 4],
``labels`` [D], ``scores`` [D] and ``masks`` float [D, 1, H, W] (probabilities, threshold 0.5).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torchvision.models.detection import RetinaNet
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.transform import GeneralizedRCNNTransform, resize_boxes
from torchvision.ops import FeaturePyramidNetwork, boxes as box_ops, roi_align
from torchvision.ops.feature_pyramid_network import ExtraFPNBlock, LastLevelP6P7
from torchvision.ops.misc import FrozenBatchNorm2d

from hpdl.runtime.errors import HpdlError

RESNETS = ("resnet10", "resnet18", "resnet34", "resnet50", "resnet101")   # resnet10: BasicBlock x [1, 1, 1, 1]


@dataclass
class SPRNetConfig:
    """Architecture and inference settings; defaults are the paper's R50-GFPN at COCO scale."""

    num_classes: int = 91                  # including background (torchvision's convention): labels 1..K
    backbone: str = "resnet50"             # one of RESNETS
    backbone_weights: str | None = None    # local torchvision ResNet state dict file (or the dict); None: random
    trainable_backbone_layers: int | None = None   # None: all 5 from scratch, 3 with weights (torchvision)
    fpn: str = "gated"                     # "gated" (GFPN) or "sum" (torchvision's FPN)
    fpn_channels: int = 256
    anchor_sizes: tuple[int, ...] = (32, 64, 128, 256, 512)   # base anchor of P3..P7 (x 2^0, 2^1/3, 2^2/3)
    min_size: int = 800                    # torchvision transform: shorter side resized to min_size ...
    max_size: int = 1333                   # ... unless the longer side would pass max_size
    mask_size: int = 32                    # m: masks are m x m in the box frame (power of two >= 8)
    class_agnostic: bool = False           # one mask per pixel instead of one per class
    enhance_channels: tuple[int, int] = (256, 128)   # 1x1 conv, each dilated conv
    decoder_channels: tuple[int, int] = (256, 128)   # linear deconvolutions, ReLU deconvolutions
    # a pixel trains the mask branch when an anchor of it has IoU above this. The paper uses 0.7 and reports
    # 0.5 within 0.2 mask AP on COCO; at 0.5 a shapes instance gets ~11 such pixels instead of ~1.8, and the
    # 1 x H200 shapes run gained 1.8 mask AP (docs/benchmarks/sprnet.md)
    mask_iou_thresh: float = 0.5
    mask_samples: int = 300                # positive anchors sampled an image for the mask loss
    # the mask frame (issue 35): "predicted" crops each target to the box its anchor decodes (detached),
    # enlarged by mask_margin about its centre, and inference pastes into the same enlargement of the detected
    # box, so training and inference share one frame; "gt" is the paper's (targets in the ground-truth box,
    # pasted into the detected box: every imperfect box distorts its mask)
    mask_frame: str = "predicted"
    # frame = box scaled by this about its centre (1.0: the box itself). 1.3 gave slightly better masks on CPU
    # (docs/benchmarks/sprnet.md) but the CI test's seed then learned no detector at all: kept at 1.2
    mask_margin: float = 1.2
    decoder_convs: int = 1                 # 3x3 convs (+ReLU) after each upsampling to m/2 and m (0: the paper's)
    # the decoder's weight init: "scaled" keeps a unit signal through every layer (variance-preserving for the
    # linear deconvolutions, Kaiming for the ReLU ones, as torchvision's Mask R-CNN head); "torch" is PyTorch's
    # default, under which the logits' spread across input vectors is ~0.004 at init (each 2x2
    # deconvolution keeps 1/12 of the variance), so the mask learned slowly (issue 35, second session)
    decoder_init: str = "scaled"
    anchor_conditioning: bool = True       # per-anchor scale and shift of the pixel's reduced vector
    # scale and shift of the reduced vector from the mask frame's box relative to the anchor (the box coder's
    # (dx, dy, dw, dh), detached): the frame is the regressed box, and without it the decoder had to re-derive
    # the box head's output to place the shape in it (issue 35, second session)
    frame_conditioning: bool = True
    score_thresh: float = 0.05
    nms_thresh: float = 0.5
    detections_per_img: int = 100          # the paper's top-100 pixels
    topk_candidates: int = 1000

    def __post_init__(self):
        self.anchor_sizes = tuple(self.anchor_sizes)
        self.enhance_channels = tuple(self.enhance_channels)
        self.decoder_channels = tuple(self.decoder_channels)
        if self.backbone not in RESNETS:
            raise ValueError(f"backbone must be one of {RESNETS}, got {self.backbone!r}")
        if self.fpn not in ("gated", "sum"):
            raise ValueError(f"fpn must be 'gated' or 'sum', got {self.fpn!r}")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 2:
            raise ValueError(f"num_classes counts background and must be an int >= 2, got {self.num_classes!r}")
        def whole(name, v, lo):   # bools, floats and NaN failed later with unrelated messages, or not at all
            return isinstance(v, int) and not isinstance(v, bool) and v >= lo

        for name in ("class_agnostic", "anchor_conditioning", "frame_conditioning"):
            if not isinstance(getattr(self, name), bool):   # a string such as "no" was truthy: silently on
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name, lo in (("fpn_channels", 1), ("decoder_convs", 0), ("detections_per_img", 1), ("topk_candidates", 1)):
            if not whole(name, getattr(self, name), lo):
                raise ValueError(f"{name} must be an int >= {lo}, got {getattr(self, name)!r}")
        for name in ("enhance_channels", "decoder_channels"):
            v = getattr(self, name)
            if len(v) != 2 or not all(whole(name, c, 1) for c in v):
                raise ValueError(f"{name} must be two ints >= 1, got {v}")
        if not all(whole("anchor_sizes", a, 1) for a in self.anchor_sizes):
            raise ValueError(f"anchor_sizes must be ints >= 1 (pixels), got {self.anchor_sizes}")
        m = self.mask_size
        if not whole("mask_size", m, 8) or m & (m - 1):
            raise ValueError(f"mask_size must be a power of two >= 8, got {m}")
        if len(self.anchor_sizes) != 5:
            raise ValueError(f"anchor_sizes needs one size for each of P3..P7 (5), got {self.anchor_sizes}")
        if not 1 <= self.min_size <= self.max_size:   # min_size 0 resized every image to nothing
            raise ValueError(f"need 1 <= min_size <= max_size (pixels), got min_size={self.min_size}, "
                             f"max_size={self.max_size}")
        if not 0.0 <= self.mask_iou_thresh < 1.0:   # above 1 no anchor is positive: only the best ones trained
            raise ValueError(f"mask_iou_thresh must be in [0, 1), got {self.mask_iou_thresh}")
        if not whole("mask_samples", self.mask_samples, 1):   # 0 silently never trained the mask branch
            raise ValueError(f"mask_samples must be >= 1 (an int: positive anchors an image), got {self.mask_samples}")
        if self.mask_frame not in ("predicted", "gt"):
            raise ValueError(f"mask_frame must be 'predicted' or 'gt', got {self.mask_frame!r}")
        if not (math.isfinite(self.mask_margin) and self.mask_margin >= 1.0):
            raise ValueError(f"mask_margin must be a finite number >= 1, got {self.mask_margin}")
        if self.decoder_convs < 0:
            raise ValueError(f"decoder_convs must be >= 0, got {self.decoder_convs}")
        if self.decoder_init not in ("scaled", "torch"):
            raise ValueError(f"decoder_init must be 'scaled' or 'torch', got {self.decoder_init!r}")
        if not 0.0 <= self.score_thresh <= 1.0 or not 0.0 <= self.nms_thresh <= 1.0:
            raise ValueError(f"score_thresh and nms_thresh must be in [0, 1], got {self.score_thresh}, "
                             f"{self.nms_thresh}")
        if self.detections_per_img < 1 or self.topk_candidates < 1:
            raise ValueError(f"detections_per_img and topk_candidates must be >= 1, got {self.detections_per_img}, "
                             f"{self.topk_candidates}")


# ---------------------------------------------------------------- backbone

class GatedFPN(FeaturePyramidNetwork):
    """FPN whose top-down merge is gated (SPRNet's GFPN): ``y = a * sigmoid(g(a)) + b * sigmoid(g(b))``.

    ``g`` is one depthwise 3x3 + pointwise 1x1 conv shared by every level and both inputs. Same constructor and
    shapes as torchvision's ``FeaturePyramidNetwork``.
    """

    def __init__(self, in_channels_list: list[int], out_channels: int, extra_blocks: ExtraFPNBlock | None = None):
        super().__init__(in_channels_list, out_channels, extra_blocks=extra_blocks)
        c = out_channels
        self.gate = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, groups=c), nn.Conv2d(c, c, 1))

    def _merge(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * torch.sigmoid(self.gate(a)) + b * torch.sigmoid(self.gate(b))

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names, feats = list(x.keys()), list(x.values())
        last = self.get_result_from_inner_blocks(feats[-1], -1)
        results = [self.get_result_from_layer_blocks(last, -1)]
        for idx in range(len(feats) - 2, -1, -1):
            lateral = self.get_result_from_inner_blocks(feats[idx], idx)
            last = self._merge(lateral, F.interpolate(last, size=lateral.shape[-2:], mode="nearest"))
            results.insert(0, self.get_result_from_layer_blocks(last, idx))
        if self.extra_blocks is not None:
            results, names = self.extra_blocks(results, feats, names)
        return OrderedDict(zip(names, results))


def load_backbone_weights(net: nn.Module, path) -> None:
    """Load a torchvision ResNet state dict, from a local file (``torch.save(resnet.state_dict())``) or given
    as a dict; ``fc.*`` ignored.

    Raises:
        HpdlError: the file is missing, or its keys or shapes do not match the ResNet (names the first few).
    """
    if isinstance(path, dict):
        state, path = path, "<state dict>"
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise HpdlError(f"backbone_weights={str(path)!r}: no such file") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict", state.get("model")), dict):
        state = state.get("state_dict", state.get("model"))
    state = {k.removeprefix("module."): v for k, v in state.items() if not k.removeprefix("module.").startswith("fc.")}
    own = {k: v for k, v in net.state_dict().items() if not k.startswith("fc.") and not k.endswith("num_batches_tracked")}
    state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    wrong = [k for k in own.keys() & state.keys() if own[k].shape != state[k].shape]
    if missing or unexpected or wrong:
        raise HpdlError(f"backbone_weights={path!r} does not fit the ResNet: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}, wrong shape {wrong[:3]}")
    net.load_state_dict(state, strict=False)


def resnet_fpn(name: str = "resnet50", *, out_channels: int = 256, returned_layers=(2, 3, 4),
               extra_blocks: ExtraFPNBlock | None = None, weights_path: str | None = None,
               trainable_layers: int | None = None, gated: bool = False) -> BackboneWithFPN:
    """A torchvision ResNet + FPN, never downloading: random init, or weights from a local file.

    With weights, batch norm is frozen and the last ``trainable_layers`` (default 3) stages train, as
    torchvision's detection builders do; from scratch, batch norm trains and so do all 5 stages.
    ``returned_layers`` (2, 3, 4) with ``LastLevelP6P7`` is RetinaNet's P3-P7; (1, 2, 3, 4) with the default
    max-pool block is Mask R-CNN's P2-P6. ``gated`` swaps the FPN for :class:`GatedFPN`.
    """
    if name not in RESNETS:
        raise ValueError(f"backbone must be one of {RESNETS}, got {name!r}")
    norm = FrozenBatchNorm2d if weights_path else nn.BatchNorm2d
    if name == "resnet10":   # not in torchvision's zoo: the smallest ResNet, for CPU tests
        net = torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], norm_layer=norm)
    else:
        net = getattr(torchvision.models, name)(weights=None, norm_layer=norm)
    if weights_path:
        load_backbone_weights(net, weights_path)
    trainable = trainable_layers if trainable_layers is not None else (3 if weights_path else 5)
    if not 0 <= trainable <= 5:
        raise ValueError(f"trainable_layers must be in 0..5, got {trainable}")
    train_prefixes = ("layer4", "layer3", "layer2", "layer1", "conv1")[:trainable] + (("bn1",) if trainable == 5 else ())
    for pname, p in net.named_parameters():
        if not pname.startswith(train_prefixes):
            p.requires_grad_(False)
    stage2 = net.inplanes // 8   # 64 (BasicBlock) or 256 (Bottleneck): channels of layer1's output
    in_channels = [stage2 * 2 ** (i - 1) for i in returned_layers]
    return_layers = {f"layer{k}": str(v) for v, k in enumerate(returned_layers)}
    backbone = BackboneWithFPN(net, return_layers, in_channels, out_channels, extra_blocks=extra_blocks)
    if gated:
        backbone.fpn = GatedFPN(in_channels, out_channels, extra_blocks=backbone.fpn.extra_blocks)
    return backbone


def retina_anchors(sizes=(32, 64, 128, 256, 512)) -> AnchorGenerator:
    """RetinaNet's anchors: per level 3 scales (x 2^0, 2^1/3, 2^2/3 of ``sizes[l]``) x 3 aspect ratios."""
    return AnchorGenerator(tuple((s, int(s * 2 ** (1 / 3)), int(s * 2 ** (2 / 3))) for s in sizes),
                           ((0.5, 1.0, 2.0),) * len(sizes))


# ---------------------------------------------------------------- SPR branch

def conv_at(feature: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int,
            b: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``conv2d(feature, weight, bias, padding=dilation * (k // 2), dilation=dilation)`` at pixels only.

    Args:
        feature: [B, C, H, W]. weight: [O, C, k, k], k odd. bias: [O] or None.
        b, y, x: int64 [P], the batch index, row and column of each wanted output pixel.
    Returns:
        [P, O], equal (to rounding) to the dense conv's output at those pixels (zero padding).
    """
    k = weight.shape[-1]
    r = (k // 2) * dilation
    fp = F.pad(feature, (r, r, r, r)) if r else feature
    off = torch.arange(k, device=feature.device) * dilation            # taps at r + (j - k//2) * dilation
    yy = y[:, None, None] + off[None, :, None]                         # [P, k, 1] rows in the padded map
    xx = x[:, None, None] + off[None, None, :]                         # [P, 1, k]
    taps = fp[b[:, None, None], :, yy, xx]                             # [P, k, k, C]
    out = torch.einsum("pijc,ocij->po", taps, weight.to(taps.dtype))
    return out if bias is None else out + bias.to(out.dtype)


class MaskEnhancement(nn.Module):
    """1x1 conv beside 3x3 convs dilated ``rates``, concatenated, ReLU: [B, C, H, W] -> [B, C', H, W]."""

    def __init__(self, in_channels: int, channels=(256, 128), rates=(2, 4, 6)):
        super().__init__()
        self.point = nn.Conv2d(in_channels, channels[0], 1)
        self.dilated = nn.ModuleList(nn.Conv2d(in_channels, channels[1], 3, padding=r, dilation=r) for r in rates)
        self.out_channels = channels[0] + len(rates) * channels[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The dense map (reference for :meth:`at`; the model itself only evaluates pixels)."""
        return F.relu(torch.cat([self.point(x)] + [c(x) for c in self.dilated], 1))

    def at(self, feature: torch.Tensor, b: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``forward(feature)[b, :, y, x]`` without the dense map: [P, C']."""
        outs = [conv_at(feature, self.point.weight, self.point.bias, 1, b, y, x)]
        outs += [conv_at(feature, c.weight, c.bias, c.dilation[0], b, y, x) for c in self.dilated]
        return F.relu(torch.cat(outs, 1))


class SPRDecoder(nn.Module):
    """One pixel's vector (and its anchor) -> mask logits: [P, C'], int64 [P] -> [P, K, m, m] (K classes, or 1).

    The paper's layers, with two additions (issue 35; both off gives the paper's decoder):

    - the 1x1 reduction, then ``log2(m) - 2`` 2x2 stride-2 deconvolutions without activation (1 -> m/4); with
      ``num_anchors``, the reduced vector is first scaled and shifted per anchor (``(1 + scale[a]) * r +
      shift[a]``, both 0 at init), so the 9 anchors of a pixel, whose boxes frame 9 different crops of the
      instance, decode 9 different masks from the one vector;
    - two deconvolutions with ReLU (m/4 -> m/2 -> m), each followed by ``convs`` 3x3 convolutions with ReLU
      (the paper's 2x2 stride-2 deconvolutions mix no neighbouring cells), then a 1x1 prediction, plus a
      nearest-upsampled 1x1 prediction from m/4 (the shortcut).

    The linear stage runs as matrix products on ``[P, positions, channels]`` with positions in quad-tree order
    (a cell's 4 children adjacent: no reordering between layers, one at the end) rather than as deconvolution
    kernels on 1x1 to 4x4 maps; :meth:`reference` is the same function through the modules.
    """

    def __init__(self, in_channels: int, num_masks: int, mask_size: int = 32, channels=(256, 128), *,
                 num_anchors: int = 0, convs: int = 0, init: str = "torch", frame_conditioning: bool = False):
        super().__init__()
        c0, c1 = channels
        n_linear = int(math.log2(mask_size)) - 2            # 1x1 -> (m/4)x(m/4) without activation
        self.mask_size = mask_size
        self.reduce = nn.Linear(in_channels, c0)            # the 1x1 conv on a 1x1 map
        self.anchor_scale = self.anchor_shift = None
        if num_anchors:
            self.anchor_scale, self.anchor_shift = nn.Embedding(num_anchors, c0), nn.Embedding(num_anchors, c0)
            nn.init.zeros_(self.anchor_scale.weight)
            nn.init.zeros_(self.anchor_shift.weight)
        self.frame_film = None
        if frame_conditioning:   # (dx, dy, dw, dh) -> (scale, shift) of the reduced vector; 0 at init
            self.frame_film = nn.Sequential(nn.Linear(4, 64), nn.ReLU(inplace=True), nn.Linear(64, 2 * c0))
            nn.init.zeros_(self.frame_film[2].weight)
            nn.init.zeros_(self.frame_film[2].bias)
        self.linear = nn.Sequential(*[nn.ConvTranspose2d(c0, c0, 2, stride=2) for _ in range(n_linear)])
        up, cin = [], c0
        for _ in range(2):
            up += [nn.ConvTranspose2d(cin, c1, 2, stride=2), nn.ReLU(inplace=True)]
            for _ in range(convs):
                up += [nn.Conv2d(c1, c1, 3, padding=1), nn.ReLU(inplace=True)]
            cin = c1
        self.up = nn.Sequential(*up)
        self.predict = nn.Conv2d(c1, num_masks, 1)
        self.predict_shortcut = nn.Conv2d(c0, num_masks, 1)
        # raster cell (r, c) of the (m/4) x (m/4) map -> its quad-tree position: the bits of r and c interleaved
        s = mask_size // 4
        levels = int(math.log2(s))
        r, c = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
        tree = sum((((r >> (levels - 1 - j)) & 1) * 2 + ((c >> (levels - 1 - j)) & 1)) * 4 ** (levels - 1 - j)
                   for j in range(levels)) if levels else torch.zeros_like(r)
        self.register_buffer("raster", tree.flatten(), persistent=False)
        if init == "scaled":
            self._scaled_init()
        elif init != "torch":
            raise ValueError(f"init must be 'scaled' or 'torch', got {init!r}")

    @torch.no_grad()
    def _scaled_init(self) -> None:
        """Normal weights of variance gain / fan_in, zero biases: gain 1 into a linear layer (the reduction's
        input and the prediction's are ReLU outputs, which halve the second moment: gain 2 there), gain 2 into a
        ReLU (He et al. 2015). A 2x2 stride-2 deconvolution's output cell reads one tap of each input channel
        (fan_in = input channels); a 3x3 conv's nine. PyTorch's default (1/3 of that variance, and fan-in taken
        from the deconvolution's output channels) loses ~12x of the signal per deconvolution."""
        def normal(w: torch.Tensor, fan_in: int, gain: float) -> None:
            w.normal_(0.0, math.sqrt(gain / fan_in))

        normal(self.reduce.weight, self.reduce.in_features, 2.0)
        for layer in self.linear:
            normal(layer.weight, layer.weight.shape[0], 1.0)          # ConvTranspose2d weight: [in, out, 2, 2]
        for layer in self.up:
            if isinstance(layer, nn.ConvTranspose2d):
                normal(layer.weight, layer.weight.shape[0], 2.0)
            elif isinstance(layer, nn.Conv2d):
                normal(layer.weight, layer.weight[0].numel(), 2.0)
        # the logits start at std ~0.5 (~1 would start the loss well above log 2)
        normal(self.predict.weight, self.predict.in_channels, 0.1 * 2.0)
        normal(self.predict_shortcut.weight, self.predict_shortcut.in_channels, 0.1)
        for m in [self.reduce, *self.linear, *self.up, self.predict, self.predict_shortcut]:
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()

    @staticmethod
    def _deconv(x: torch.Tensor, layer: nn.ConvTranspose2d) -> torch.Tensor:
        """A 2x2 stride-2 deconvolution on quad-tree-ordered positions: [P, S, C] -> [P, 4S, O]."""
        c, o = layer.weight.shape[:2]
        w = layer.weight.permute(2, 3, 1, 0).reshape(4 * o, c)    # row (2a + b) * O + o: child (a, b)'s output o
        bias = None if layer.bias is None else layer.bias.repeat(4)
        return F.linear(x, w, bias).view(x.shape[0], 4 * x.shape[1], o)

    def _reduced(self, v: torch.Tensor, anchor: torch.Tensor | None, frame: torch.Tensor | None) -> torch.Tensor:
        r = self.reduce(v)                                                  # [P, c0]
        scale = shift = None
        if self.anchor_scale is not None:
            if anchor is None:
                raise ValueError("this decoder is conditioned on anchors: give each vector's anchor (int64 [P])")
            scale, shift = self.anchor_scale(anchor).to(r.dtype), self.anchor_shift(anchor).to(r.dtype)
        if self.frame_film is not None:
            if frame is None:
                raise ValueError("this decoder is conditioned on the mask frame: give each vector's frame "
                                 "(float [P, 4], the box coder's deltas of the frame's box from the anchor)")
            fs, fb = self.frame_film(frame.to(self.frame_film[0].weight.dtype)).to(r.dtype).chunk(2, 1)
            scale, shift = (fs, fb) if scale is None else (scale + fs, shift + fb)
        return r if scale is None else r * (1 + scale) + shift

    def _features(self, v: torch.Tensor, anchor: torch.Tensor | None,
                  frame: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """[P, C'] -> the (m/4)^2 map [P, c0, m/4, m/4] (the shortcut's input) and the m^2 map [P, c1, m, m]."""
        a = self._reduced(v, anchor, frame)[:, None, :]                           # [P, 1, c0]
        for layer in self.linear:
            a = self._deconv(a, layer)                                      # [P, 4^k, c0], quad-tree order
        s = self.mask_size // 4
        a = a[:, self.raster].transpose(1, 2).reshape(len(v), a.shape[-1], s, s)   # raster [P, c0, s, s]
        return a, self.up(a)

    @staticmethod
    def _upsample4(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(4, -1).repeat_interleave(4, -2)

    def forward(self, v: torch.Tensor, anchor: torch.Tensor | None = None,
                frame: torch.Tensor | None = None) -> torch.Tensor:
        """All mask channels: [P, C'], int64 [P] (each vector's anchor, 0..A-1), float [P, 4] (its frame's box
        coder deltas from the anchor) -> [P, K, m, m]."""
        a, h = self._features(v, anchor, frame)
        return self.predict(h) + self._upsample4(self.predict_shortcut(a))

    def forward_channels(self, v: torch.Tensor, channel: torch.Tensor, anchor: torch.Tensor | None = None,
                         frame: torch.Tensor | None = None):
        """One channel a vector (its class, or 0 class-agnostic): [P, C'], int64 [P] -> [P, m, m].

        Equal to ``forward(v, anchor, frame)[arange(P), channel]`` without computing the other K - 1 channels."""
        a, h = self._features(v, anchor, frame)
        w, b = self.predict.weight[channel, :, 0, 0], self.predict.bias[channel]                 # [P, c1], [P]
        ws, bs = self.predict_shortcut.weight[channel, :, 0, 0], self.predict_shortcut.bias[channel]
        out = torch.einsum("pchw,pc->phw", h, w.to(h.dtype)) + b[:, None, None].to(h.dtype)
        short = torch.einsum("pchw,pc->phw", a, ws.to(a.dtype)) + bs[:, None, None].to(a.dtype)
        return out + self._upsample4(short)

    def reference(self, v: torch.Tensor, anchor: torch.Tensor | None = None,
                  frame: torch.Tensor | None = None) -> torch.Tensor:
        """The same function through the deconvolution modules (for tests): [P, C'] -> [P, K, m, m]."""
        a = self.linear(self._reduced(v, anchor, frame)[:, :, None, None])   # [P, c0, m/4, m/4]
        return self.predict(self.up(a)) + F.interpolate(self.predict_shortcut(a), scale_factor=4, mode="nearest")


def mask_frame(boxes: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """The box a mask lives in: ``boxes`` [N, 4] (x1, y1, x2, y2) scaled by ``margin`` about their centres,
    at least 1 pixel a side (a degenerate box would otherwise be a 0-pixel frame). Float [N, 4]."""
    boxes = boxes.float()
    centre = (boxes[:, :2] + boxes[:, 2:]) / 2
    half = ((boxes[:, 2:] - boxes[:, :2]) * margin).clamp(min=1.0) / 2
    return torch.cat([centre - half, centre + half], 1)


def encode_masks(masks: torch.Tensor, boxes: torch.Tensor, mask_size: int,
                 index: torch.Tensor | None = None) -> torch.Tensor:
    """SPR targets: masks [N, H, W] cropped to boxes [n, 4] (x1, y1, x2, y2) -> bool [n, m, m].

    Box ``k`` crops mask ``index[k]`` (int64 [n]; default: mask ``k``, n = N). Bilinear (roi_align, aligned pixel
    centres, 2x2 samples a cell; zero outside the image), then >= 0.5. :func:`paste_masks` inverts it.
    """
    if index is None:
        index = torch.arange(len(boxes), device=boxes.device)
    if len(masks) == 0 or len(boxes) == 0:
        return masks.new_zeros((len(boxes) if len(masks) else 0, mask_size, mask_size), dtype=torch.bool)
    if not torch.isfinite(boxes).all():   # roi_align reads out of bounds (a segfault on CPU) at NaN/inf
        raise ValueError(f"boxes must be finite, got {boxes[~torch.isfinite(boxes).all(1)][:3].tolist()}")
    rois = torch.cat([index.to(boxes.device, boxes.dtype)[:, None], boxes], 1)
    crop = roi_align(masks[:, None].float(), rois.float(), (mask_size, mask_size), 1.0, sampling_ratio=2, aligned=True)
    return crop[:, 0] >= 0.5


def paste_masks(masks: torch.Tensor, boxes: torch.Tensor, image_size: tuple[int, int],
                max_elements: int = 1 << 26) -> torch.Tensor:
    """Paste box-frame masks [N, 1, m, m] into an image: -> [N, 1, H, W].

    Mask cell edges map to the box edges; pixels whose centre lies in the box get the bilinear value (edge cells
    extended to the box's border), the others 0, so ``paste_masks(encode_masks(M, B), B) >= 0.5`` recovers ``M``
    up to resampling, exactly for a box-shaped ``M``. Batched and free of host syncs (torchvision's
    ``paste_masks_in_image`` loops over detections in Python and reads each box on the host).
    """
    h, w = image_size
    n = len(masks)
    if n == 0:
        return masks.new_zeros((0, 1, h, w), dtype=torch.float32)
    boxes = boxes.float()
    xs = torch.arange(w, device=masks.device, dtype=torch.float32) + 0.5
    ys = torch.arange(h, device=masks.device, dtype=torch.float32) + 0.5
    x0, y0, x1, y1 = boxes.unbind(1)
    gx = (xs[None] - x0[:, None]) / (x1 - x0).clamp(min=1e-3)[:, None] * 2 - 1      # [N, W]
    gy = (ys[None] - y0[:, None]) / (y1 - y0).clamp(min=1e-3)[:, None] * 2 - 1      # [N, H]
    out = []
    step = max(1, max_elements // max(1, h * w))
    for i in range(0, n, step):
        sx, sy = gx[i:i + step], gy[i:i + step]
        grid = torch.stack([sx[:, None, :].expand(-1, h, -1), sy[:, :, None].expand(-1, -1, w)], -1)
        inside = ((sx.abs() <= 1)[:, None, :] & (sy.abs() <= 1)[:, :, None])[:, None]
        out.append(F.grid_sample(masks[i:i + step].float(), grid, mode="bilinear", padding_mode="border",
                                 align_corners=False) * inside)
    return torch.cat(out)


class PastingTransform(GeneralizedRCNNTransform):
    """torchvision's detection transform, its ``postprocess`` pasting masks with :func:`paste_masks` into each
    box's :func:`mask_frame` (``mask_margin``; 1.0: the box itself)."""

    def __init__(self, *args, mask_margin: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.mask_margin = mask_margin

    def postprocess(self, result, image_shapes, original_image_sizes):
        if self.training:
            return result
        for pred, size, original in zip(result, image_shapes, original_image_sizes):
            pred["boxes"] = resize_boxes(pred["boxes"], size, original)
            if "masks" in pred:
                pred["masks"] = paste_masks(pred["masks"], mask_frame(pred["boxes"], self.mask_margin), original)
        return result


def spr_positives(iou: torch.Tensor, iou_thresh: float = 0.5,
                  max_samples: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """SPR positive anchors of one image and the instance each reconstructs.

    The paper makes a *pixel* positive when one of its anchors has IoU > 0.7 and trains that pixel's one mask.
    Here each such anchor is a sample: its mask lives in the frame of its own decoded box and the decoder is
    conditioned on the anchor (issue 35), so the 9 anchors of a pixel decode different masks from one vector.

    Args:
        iou: [G, P * A] IoU of each ground-truth box with each anchor (torchvision's order, anchor ``i`` of pixel
            ``i // A``).
    Returns:
        ``(anchors, instances)``, int64 [n] each, n <= max_samples: an anchor is positive when its IoU with its
        best box is above ``iou_thresh``, and that box is its instance. Each instance also keeps its best anchor
        (when that IoU is above 0), as torchvision's low-quality matches. More positives are sampled at random.
    """
    g = iou.shape[0]
    best_iou, best_gt = iou.max(0)                                   # per anchor
    positive = best_iou > iou_thresh
    top_iou, top = iou.max(1)                                         # each instance's best anchor
    own = top_iou > 0
    positive[top[own]] = True
    best_gt = best_gt.clone()
    best_gt[top[own]] = torch.arange(g, device=iou.device)[own]
    anchors = positive.nonzero()[:, 0]
    if len(anchors) > max_samples:
        anchors = anchors[torch.randperm(len(anchors), device=anchors.device)[:max_samples]]
    return anchors, best_gt[anchors]


# ---------------------------------------------------------------- model

def spr_mask_loss(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Mean per-pixel binary cross-entropy of mask logits [n, m, m] against bool targets [n, m, m] (fp32)."""
    return F.binary_cross_entropy_with_logits(logits.float(), masks.float())


def _check_target(j: int, t: dict, image: torch.Tensor | None, num_classes: int) -> None:
    """Reject a training target that would train on garbage: torchvision's RetinaNet/Mask R-CNN check boxes
    for positive size (an inverted box gives a NaN box loss, a zero-width one a huge one); masks must be one
    per box at the image's size (a missing mask made ``roi_align`` read past the mask tensor; a NaN or infinite
    box crashed the process in ``roi_align``); labels integers in ``1..num_classes-1`` (a larger one was an
    IndexError deep inside torchvision's loss; a label 0 trained the background column as a class, and the COCO
    export drops label-0 detections)."""
    boxes, labels, masks = t["boxes"], t["labels"], t["masks"]
    if boxes.ndim != 2 or boxes.shape[-1] != 4:
        raise ValueError(f"targets[{j}]['boxes'] must be [N, 4], got {list(boxes.shape)}")
    if not boxes.is_floating_point():
        raise ValueError(f"targets[{j}]['boxes'] must be a float tensor, got {boxes.dtype}")
    n = boxes.shape[0]
    bad = ~torch.isfinite(boxes).all(1) | (boxes[:, 2:] <= boxes[:, :2]).any(1)   # NaN/inf: roi_align crashed
    if bad.any():
        k = int(bad.nonzero()[0, 0])
        raise ValueError(f"targets[{j}]['boxes'][{k}] = {boxes[k].tolist()}: boxes must be (x1, y1, x2, y2) with "
                         "finite coordinates and positive width and height")
    if labels.shape != (n,):
        raise ValueError(f"targets[{j}]['labels'] must be [{n}] (one per box), got {list(labels.shape)}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"targets[{j}]['labels'] must be an integer tensor (int64), got {labels.dtype}")
    if n and (int(labels.min()) < 1 or int(labels.max()) >= num_classes):
        raise ValueError(f"targets[{j}]['labels'] must be in 1..{num_classes - 1} (num_classes={num_classes}; "
                         f"0 is background), got {labels.tolist()}")
    size = tuple(image.shape[-2:]) if image is not None else tuple(masks.shape[-2:])
    if masks.ndim != 3 or masks.shape[0] != n or tuple(masks.shape[-2:]) != size:
        raise ValueError(f"targets[{j}]['masks'] must be [{n}, {size[0]}, {size[1]}] (one per box, at the image's "
                         f"size), got {list(masks.shape)}")
    if masks.dtype not in (torch.uint8, torch.bool):   # float masks (probabilities, 0-255) were cut at 0.5
        raise ValueError(f"targets[{j}]['masks'] must be uint8 or bool (0/1 per pixel), got {masks.dtype}")
    if n:
        h, w = size
        outside = (boxes[:, 0] >= w) | (boxes[:, 1] >= h) | (boxes[:, 2] <= 0) | (boxes[:, 3] <= 0)
        if outside.any():   # nothing of the instance can be seen: an all-zero target that trains "no object"
            k = int(outside.nonzero()[0, 0])
            raise ValueError(f"targets[{j}]['boxes'][{k}] = {boxes[k].tolist()} lies entirely outside the "
                             f"{w}x{h} image")
        empty = masks.flatten(1).amax(1) == 0   # (any() of uint8 is uint8, and ~ of it is not a test)
        if empty.any():   # trained the mask branch to predict nothing inside a box
            k = int(empty.nonzero()[0, 0])
            raise ValueError(f"targets[{j}]['masks'][{k}] is all zero: every instance needs at least one pixel "
                             "(leave empty instances out, as CocoInstances does)")


def _check_finite(images, which) -> None:
    """Raise ValueError naming the first of ``images[which]`` with NaN or infinite pixels (one host sync)."""
    which = list(which)
    if not which:
        return
    finite = torch.stack([torch.isfinite(images[i]).all() for i in which])
    if not bool(finite.all()):   # a NaN image gave 0 detections silently, and a NaN loss in training
        raise ValueError(f"images[{which[int((~finite).nonzero()[0, 0])]}] has NaN or infinite pixels")


class SPRNet(RetinaNet):
    """RetinaNet with the single-pixel reconstruction branch (see the module docstring).

    Example::

        model = SPRNet(SPRNetConfig(num_classes=4, backbone="resnet18", min_size=128, max_size=128)).eval()
        out = model([torch.rand(3, 128, 128)])[0]     # boxes [D, 4], labels [D], scores [D], masks [D, 1, 128, 128]
    """

    def __init__(self, config: SPRNetConfig | int | None = None, **overrides):
        if config is None or isinstance(config, int) and not isinstance(config, bool):
            # SPRNet(4) or SPRNet(num_classes=4, backbone="resnet18"): torchvision's models take num_classes
            cfg = SPRNetConfig(**({"num_classes": config} if config is not None else {}), **overrides)
        elif isinstance(config, SPRNetConfig):
            if overrides:
                raise TypeError(f"give SPRNetConfig fields in the config, or num_classes and fields, not both: "
                                f"{sorted(overrides)}")
            cfg = config
        else:
            raise TypeError(f"config must be an SPRNetConfig or num_classes (int), got {type(config).__name__}")
        c = cfg.fpn_channels
        backbone = resnet_fpn(cfg.backbone, out_channels=c, returned_layers=(2, 3, 4),
                              extra_blocks=LastLevelP6P7(c, c), weights_path=cfg.backbone_weights,
                              trainable_layers=cfg.trainable_backbone_layers, gated=cfg.fpn == "gated")
        super().__init__(backbone, cfg.num_classes, min_size=cfg.min_size, max_size=cfg.max_size,
                         anchor_generator=retina_anchors(cfg.anchor_sizes), score_thresh=cfg.score_thresh,
                         nms_thresh=cfg.nms_thresh, detections_per_img=cfg.detections_per_img,
                         topk_candidates=cfg.topk_candidates)
        self.config = cfg
        self.transform = PastingTransform(cfg.min_size, cfg.max_size, self.transform.image_mean,
                                          self.transform.image_std, mask_margin=cfg.mask_margin)
        self.num_anchors = self.anchor_generator.num_anchors_per_location()[0]
        self.enhance = MaskEnhancement(c, cfg.enhance_channels)
        self.decoder = SPRDecoder(self.enhance.out_channels, 1 if cfg.class_agnostic else cfg.num_classes,
                                  cfg.mask_size, cfg.decoder_channels, convs=cfg.decoder_convs,
                                  init=cfg.decoder_init, frame_conditioning=cfg.frame_conditioning,
                                  num_anchors=self.num_anchors if cfg.anchor_conditioning else 0)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    # ---- the SPR branch on selected pixels
    def pixel_features(self, features: list[torch.Tensor], b: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        """Enhanced vectors [P, C'] of pixels ``pixels`` (int64 [P], indices into the levels concatenated
        row-major) of images ``b`` (int64 [P]): ``enhance(features[l])[b, :, y, x]`` for each pixel's level l.

        One gather for every tap of every enhancement conv on every level, then one matrix product a conv, with
        no host synchronisation: the per-level tables are made once per pyramid shape and kept on the device
        (a host-to-device copy from pageable memory waits for the stream). The per-level :func:`conv_at` is
        the reference."""
        convs = [(self.enhance.point, 1)] + [(c, c.dilation[0]) for c in self.enhance.dilated]
        r = max(d * (conv.weight.shape[-1] // 2) for conv, d in convs)
        dev, ch = pixels.device, features[0].shape[1]
        if len(pixels) == 0:
            return features[0].new_zeros((0, self.enhance.out_channels))
        padded = [F.pad(f, (r, r, r, r)) for f in features]
        flat = torch.cat([p.flatten(2) for p in padded], 2).transpose(1, 2).reshape(-1, ch)   # [B * L, C]
        start, width, padded_start, total = self._level_tables(tuple(tuple(f.shape[-2:]) for f in features), r, dev)
        level = torch.searchsorted(start, pixels, right=True) - 1
        local, w = pixels - start[level], width[level]
        pw = w + 2 * r                                                   # padded width of the pixel's level
        centre = b * total + padded_start[level] + (local // w + r) * pw + local % w + r
        offsets = []
        for conv, d in convs:                                          # tap (i, j): row/column (i|j - k//2) * d
            k = conv.weight.shape[-1]
            t = (torch.arange(k, device=dev) - k // 2) * d
            offsets.append((t[:, None, None] * pw + t[None, :, None]).reshape(k * k, -1).T)     # [P, k*k]
        idx = centre[:, None] + torch.cat(offsets, 1)                                            # [P, T]
        taps = flat.index_select(0, idx.flatten()).view(len(pixels), -1, ch)                  # [P, T, C]
        outs, t0 = [], 0
        for conv, _ in convs:
            o, _, k, _ = conv.weight.shape
            w2 = conv.weight.permute(0, 2, 3, 1).reshape(o, k * k * ch)
            outs.append(F.linear(taps[:, t0:t0 + k * k].reshape(len(pixels), -1), w2, conv.bias))
            t0 += k * k
        return F.relu(torch.cat(outs, 1))

    def _level_tables(self, shapes: tuple, r: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(start, width, padded_start, padded_total)`` of pyramid levels of ``shapes`` ((H, W) each) padded by
        ``r``: int64 [L] tensors on ``device`` (cached: a few pyramid shapes a run) and a Python int."""
        key = (shapes, r, str(device))
        cache = self.__dict__.setdefault("_level_cache", {})
        if key not in cache:
            if len(cache) > 64:   # training on many image sizes: keep the memory bounded
                cache.clear()
            hw = [h * w for h, w in shapes]
            padded = [(h + 2 * r) * (w + 2 * r) for h, w in shapes]
            starts = [sum(hw[:i]) for i in range(len(hw))]
            padded_starts = [sum(padded[:i]) for i in range(len(padded))]
            table = torch.tensor([starts, [w for _, w in shapes], padded_starts], dtype=torch.int64).to(device)
            cache[key] = (table[0], table[1], table[2], sum(padded))
        return cache[key]

    def pixel_features_reference(self, features, b, pixels) -> torch.Tensor:
        """:meth:`pixel_features` level by level through :func:`conv_at` (for tests)."""
        parts, order, start = [], [], 0
        for f in features:
            h, w = f.shape[-2:]
            sel = ((pixels >= start) & (pixels < start + h * w)).nonzero()[:, 0]
            if len(sel):
                local = pixels[sel] - start
                parts.append(self.enhance.at(f, b[sel], local // w, local % w))
                order.append(sel)
            start += h * w
        if not parts:
            return features[0].new_zeros((0, self.enhance.out_channels))
        out = torch.empty((len(pixels), self.enhance.out_channels), dtype=parts[0].dtype, device=parts[0].device)
        out[torch.cat(order)] = torch.cat(parts)
        return out

    def frame_deltas(self, boxes: torch.Tensor, anchor_boxes: torch.Tensor) -> torch.Tensor | None:
        """The decoder's frame input: the box coder's (dx, dy, dw, dh) of the frames' boxes [P, 4] (before the
        margin, at least 1 pixel a side) from their anchors' boxes [P, 4]; float32 [P, 4], None when the decoder
        takes no frame (``frame_conditioning=False``)."""
        if not self.config.frame_conditioning:
            return None
        return self.box_coder.encode_single(mask_frame(boxes, 1.0), anchor_boxes.float())

    def mask_logits(self, features, b, anchors, labels, frames: torch.Tensor | None = None) -> torch.Tensor:
        """Anchors (int64 [P], indices into the levels' anchors concatenated, pixel-major) of images ``b``, their
        labels and frames (:meth:`frame_deltas`) -> the labels' mask logits [P, m, m] (channel 0 when
        class-agnostic). One vector a pixel: the anchors of a pixel share its vector and differ by the anchor
        and frame conditioning and their frames."""
        channel = torch.zeros_like(labels) if self.config.class_agnostic else labels
        a = self.num_anchors
        slot = anchors % a if self.config.anchor_conditioning else None
        return self.decoder.forward_channels(self.pixel_features(features, b, anchors // a), channel, slot, frames)

    # ---- training
    def assign(self, targets, anchors, box_regression=None, image_sizes=None):
        """Training assignments of a batch (boxes and masks in the transformed frame).

        Args:
            box_regression: [B, P * A, 4] the head's output, whose decoded boxes (detached, clipped to
                ``image_sizes``) frame the mask targets when ``mask_frame="predicted"``; None: the anchors.
        Returns:
            ``(matched, spr)``: ``matched`` per image, int64 [P * A], the box each anchor is matched to by
            RetinaNet's Matcher (IoU >= 0.5; -1 background, -2 ignored in (0.4, 0.5)); ``spr`` the SPR
            positives of the whole batch: ``image``, ``anchor``, ``label`` int64 [n] and ``mask`` bool [n, m, m],
            the instance's mask in the anchor's frame (:func:`spr_positives`, :func:`mask_frame`,
            :func:`encode_masks`), and ``frame`` float [n, 4] (:meth:`frame_deltas`; absent without frame
            conditioning).
        """
        cfg = self.config
        matched, spr = [], {"image": [], "anchor": [], "label": [], "mask": [], "frame": []}
        for i, (anchors_i, t) in enumerate(zip(anchors, targets)):
            if t["boxes"].numel() == 0:
                matched.append(torch.full((len(anchors_i),), -1, dtype=torch.int64, device=anchors_i.device))
                continue
            iou = box_ops.box_iou(t["boxes"], anchors_i)
            matched.append(self.proposal_matcher(iou))
            idx, gt = spr_positives(iou, cfg.mask_iou_thresh, cfg.mask_samples)
            if cfg.mask_frame == "gt":
                boxes = t["boxes"][gt]
            else:   # the box this anchor regresses now, as inference will paste into it (no gradient through it)
                boxes = anchors_i[idx] if box_regression is None else \
                    self.box_coder.decode_single(box_regression[i, idx].detach().float(), anchors_i[idx])
                if image_sizes is not None:
                    boxes = box_ops.clip_boxes_to_image(boxes, image_sizes[i])
            frame = mask_frame(boxes, cfg.mask_margin)
            if cfg.frame_conditioning:
                spr["frame"].append(self.frame_deltas(boxes, anchors_i[idx]))
            spr["image"].append(torch.full_like(idx, i))
            spr["anchor"].append(idx)
            spr["label"].append(t["labels"][gt])
            spr["mask"].append(encode_masks(t["masks"], frame, cfg.mask_size, index=gt))
        if not spr["anchor"]:
            z, m = torch.zeros(0, dtype=torch.int64, device=anchors[0].device), cfg.mask_size
            return matched, {"image": z, "anchor": z, "label": z, "mask": z.new_zeros((0, m, m), dtype=torch.bool)}
        return matched, {k: torch.cat(v) for k, v in spr.items() if v}

    def compute_loss(self, targets, head_outputs, anchors, features, image_sizes=None):
        """``{"classification", "bbox_regression"}`` (torchvision's RetinaNet heads) and ``"mask"``
        (:func:`spr_mask_loss` of the decoded positive anchors)."""
        matched, spr = self.assign(targets, anchors, head_outputs["bbox_regression"], image_sizes)
        losses = self.head.compute_loss(targets, {k: v.float() for k, v in head_outputs.items()}, anchors, matched)
        if len(spr["anchor"]) == 0:   # keep the branch in the graph (DDP) with a zero loss
            losses["mask"] = sum(p.sum() for p in (*self.enhance.parameters(), *self.decoder.parameters())) * 0.0
        else:
            losses["mask"] = spr_mask_loss(self.mask_logits(features, spr["image"], spr["anchor"], spr["label"],
                                                            spr.get("frame")),
                                           spr["mask"])
        return losses

    # ---- inference
    def detect(self, head_outputs, anchors, image_sizes, level_lengths) -> tuple[list[dict], list[torch.Tensor]]:
        """torchvision RetinaNet's post-processing, also returning each detection's anchor index.

        Per level the ``topk_candidates`` best (anchor, class) scores above ``score_thresh`` (taken as the
        top-k of the level, then thresholded: the same set as torchvision's threshold-then-top-k, with one
        host sync an image instead of one a level), decoded and clipped; then class-wise NMS and the best
        ``detections_per_img``. ``level_lengths``: anchors on each level (H * W * A), in head-output order.
        """
        cls_logits, box_regression = head_outputs["cls_logits"], head_outputs["bbox_regression"]
        num_classes = cls_logits.shape[-1]
        detections, pixels = [], []
        for i, image_size in enumerate(image_sizes):
            scores_i = torch.sigmoid(cls_logits[i].float())                # [P * A, K]
            top_scores, top_flat, start = [], [], 0
            for length in level_lengths:
                level = scores_i[start:start + length].flatten()
                sc, idx = level.topk(min(self.topk_candidates, level.numel()))
                top_scores.append(sc)
                top_flat.append(idx + start * num_classes)
                start += length
            scores, flat = torch.cat(top_scores), torch.cat(top_flat)
            keep = scores > self.score_thresh
            scores, flat = scores[keep], flat[keep]
            anchor_idx = torch.div(flat, num_classes, rounding_mode="floor")
            labels = flat % num_classes
            boxes = self.box_coder.decode_single(box_regression[i, anchor_idx].float(), anchors[i][anchor_idx])
            boxes = box_ops.clip_boxes_to_image(boxes, image_size)
            keep = box_ops.batched_nms(boxes, scores, labels, self.nms_thresh)[: self.detections_per_img]
            detections.append({"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]})
            pixels.append(anchor_idx[keep])
        return detections, pixels

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None):
        """Training (``model.train()``, targets required): the loss dict. Inference: one dict an image."""
        if not isinstance(images, torch.Tensor) and len(images) == 0:
            raise ValueError("images is empty: give a list of at least one float [C, H, W] tensor")
        cfg = self.config
        for j, img in enumerate(images):
            if img.ndim != 3 or img.shape[0] not in (1, 3):   # 1: grey, broadcast by the normalisation
                raise ValueError(f"images[{j}] must be [3, H, W] (RGB) or [1, H, W] (grey), got {list(img.shape)}")
            if not img.is_floating_point():
                raise ValueError(f"images[{j}] must be a float tensor in 0-1, got {img.dtype}")
            h, w = img.shape[-2:]
            scale = min(cfg.min_size / max(1, min(h, w)), cfg.max_size / max(1, max(h, w)))
            if int(min(h, w) * scale) < 1:   # interpolate failed on the 0-pixel side deep in the transform
                raise ValueError(f"images[{j}] is {w}x{h} pixels: resized to min_size={cfg.min_size}, max_size="
                                 f"{cfg.max_size} its shorter side would be under one pixel")
        if self.training:
            _check_finite(images, range(len(images)))
        if self.training:
            if targets is None:
                raise ValueError("targets are required in training mode (boxes, labels, masks per image)")
            if len(targets) != len(images):
                raise ValueError(f"targets must be one dict per image: {len(images)} images, {len(targets)} targets")
            for j, t in enumerate(targets):
                for key in ("boxes", "labels", "masks"):
                    if key not in t:
                        raise ValueError(f"targets[{j}] lacks {key!r}; SPRNet trains on boxes, labels and masks")
                _check_target(j, t, images[j], self.config.num_classes)
        original_sizes = [(int(img.shape[-2]), int(img.shape[-1])) for img in images]
        images_in = images
        images, targets = self.transform(images, targets)
        features = list(self.backbone(images.tensors).values())
        head_outputs = self.head(features)
        anchors = self.anchor_generator(images, features)
        if self.training:
            return self.compute_loss(targets, head_outputs, anchors, features, images.image_sizes)
        lengths = [f.shape[-2] * f.shape[-1] * self.num_anchors for f in features]
        detections, anchor_idx = self.detect(head_outputs, anchors, images.image_sizes, lengths)
        counts = [len(p) for p in anchor_idx]
        # a NaN image has NaN scores, so no detection: checked only then (no host sync on the common path)
        _check_finite(images_in, [i for i, n in enumerate(counts) if n == 0])
        b = torch.cat([torch.full((n,), i, dtype=torch.int64, device=p.device) for i, (n, p) in
                       enumerate(zip(counts, anchor_idx))])
        labels = torch.cat([d["labels"] for d in detections])
        frames = self.frame_deltas(torch.cat([d["boxes"] for d in detections]),
                                   torch.cat([a[p] for a, p in zip(anchors, anchor_idx)]))
        masks = torch.sigmoid(self.mask_logits(features, b, torch.cat(anchor_idx), labels, frames).float())[:, None]
        for d, m in zip(detections, masks.split(counts)):
            d["masks"] = m
        return self.transform.postprocess(detections, images.image_sizes, original_sizes)


def sprnet_resnet50_fpn(*, weights=None, progress: bool = True, num_classes: int | None = None,
                        weights_backbone=None, trainable_backbone_layers: int | None = None, **kwargs) -> SPRNet:
    """SPRNet R50-GFPN, built like torchvision's ``retinanet_resnet50_fpn`` (keyword arguments only).

    Args:
        weights: pretrained SPRNet weights; none are published, so only None is accepted.
        num_classes: including background (default 91, COCO's torchvision convention).
        weights_backbone: ImageNet ResNet-50 weights: None (random init, the default: nothing is downloaded,
            unlike torchvision's builder), a local state-dict file, a state dict, or a torchvision
            ``ResNet50_Weights`` member (torchvision downloads it to its cache, ``progress`` shown).
        trainable_backbone_layers: 0-5 stages that train (default: 3 with weights, 5 without).
        kwargs: further :class:`SPRNetConfig` fields (``fpn="sum"``, ``min_size=512``, ...).
    Raises:
        ValueError: ``weights`` given, or a bad config field (named).
        HpdlError: ``weights_backbone`` names a file that does not exist, or one that does not fit a ResNet-50.

    Example::

        model = sprnet_resnet50_fpn(num_classes=4, min_size=256, max_size=426).eval()
    """
    if weights is not None:
        raise ValueError(f"weights={weights!r}: no pretrained SPRNet weights exist; use weights_backbone")
    if weights_backbone is not None and hasattr(weights_backbone, "get_state_dict"):   # a torchvision WeightsEnum
        weights_backbone = weights_backbone.get_state_dict(progress=progress)
    elif isinstance(weights_backbone, (str, os.PathLike)) and not os.path.isfile(weights_backbone):
        # name the builder's argument, not the config field the file is passed on to
        raise HpdlError(f"weights_backbone={os.fspath(weights_backbone)!r}: no such file")
    for key in ("backbone", "backbone_weights", "trainable_backbone_layers"):
        if key in kwargs:
            raise TypeError(f"sprnet_resnet50_fpn sets {key!r} itself (a ResNet-50; use weights_backbone, "
                            "trainable_backbone_layers); build SPRNet(SPRNetConfig(...)) for others")
    cfg = SPRNetConfig(num_classes=91 if num_classes is None else num_classes, backbone="resnet50",
                       backbone_weights=weights_backbone, trainable_backbone_layers=trainable_backbone_layers,
                       **kwargs)
    return SPRNet(cfg)
