"""SPRNet: output formats, the SPR branch's exact pieces (sparse convs, positives, encode/paste, decoder), losses."""

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchvision")

from torchvision.models.detection._utils import Matcher  # noqa: E402

from hpdl.models.sprnet import (  # noqa: E402
    MaskEnhancement, SPRDecoder, SPRNet, SPRNetConfig, conv_at, encode_masks, mask_frame, paste_masks, resnet_fpn,
    retina_anchors, spr_mask_loss, spr_positives, sprnet_resnet50_fpn,
)
from hpdl.runtime.errors import HpdlError  # noqa: E402

SMALL = dict(num_classes=4, backbone="resnet10", fpn_channels=16, anchor_sizes=(8, 16, 32, 64, 128), min_size=64,
             max_size=64, enhance_channels=(16, 8), decoder_channels=(16, 8))


def tiny(**kw) -> SPRNet:
    torch.manual_seed(0)
    return SPRNet(SPRNetConfig(**{**SMALL, **kw}))


def box_mask(h, w, box) -> torch.Tensor:
    m = torch.zeros(h, w, dtype=torch.uint8)
    x0, y0, x1, y1 = box
    m[y0:y1, x0:x1] = 1
    return m


def disc(h, w, cx, cy, r) -> torch.Tensor:
    ys, xs = torch.meshgrid(torch.arange(h) + 0.5, torch.arange(w) + 0.5, indexing="ij")
    return ((xs - cx) ** 2 + (ys - cy) ** 2 <= r * r).to(torch.uint8)


def sample_batch():
    images = [torch.rand(3, 64, 64), torch.rand(3, 48, 80)]
    m0 = torch.stack([disc(64, 64, 20, 22, 12), box_mask(64, 64, (34, 30, 60, 58))])
    m1 = disc(48, 80, 50, 24, 14)[None]
    targets = [{"boxes": torch.tensor([[8., 10, 32, 34], [34, 30, 60, 58]]), "labels": torch.tensor([1, 3]),
                "masks": m0},
               {"boxes": torch.tensor([[36., 10, 64, 38]]), "labels": torch.tensor([2]), "masks": m1}]
    return images, targets


# ---------------------------------------------------------------- formats

def test_training_returns_the_three_losses_and_they_backpropagate():
    model = tiny().train()
    images, targets = sample_batch()
    losses = model(images, targets)
    assert set(losses) == {"classification", "bbox_regression", "mask"}
    for v in losses.values():
        assert v.ndim == 0 and torch.isfinite(v) and v.requires_grad
    sum(losses.values()).backward()
    assert model.decoder.predict.weight.grad.abs().sum() > 0 and model.enhance.point.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kw", [{}, {"class_agnostic": True, "fpn": "sum"}, {"mask_size": 16}])
def test_inference_outputs_torchvision_format_at_the_original_size(kw):
    model = tiny(score_thresh=0.0, detections_per_img=7, **kw).eval()
    images, _ = sample_batch()
    with torch.no_grad():
        out = model(images)
    assert len(out) == 2
    for o, im in zip(out, images):
        assert set(o) == {"boxes", "labels", "scores", "masks"}
        n = len(o["boxes"])
        assert n == 7    # score_thresh 0: the top detections_per_img survive NMS on random weights
        assert o["boxes"].shape == (n, 4) and o["boxes"].dtype == torch.float32
        assert o["labels"].dtype == torch.int64 and o["scores"].shape == (n,)
        assert o["masks"].shape == (n, 1, *im.shape[-2:]) and o["masks"].dtype == torch.float32
        assert (o["masks"] >= 0).all() and (o["masks"] <= 1).all()
        h, w = im.shape[-2:]
        assert (o["boxes"][:, 0::2] <= w).all() and (o["boxes"][:, 1::2] <= h).all() and (o["boxes"] >= 0).all()
        assert ((o["labels"] >= 0) & (o["labels"] < SMALL["num_classes"])).all()
        assert (o["scores"][:-1] >= o["scores"][1:]).all()


def test_no_detection_gives_empty_outputs_of_the_right_shapes():
    model = tiny(score_thresh=1.0).eval()
    with torch.no_grad():
        o = model([torch.rand(3, 64, 64)])[0]
    assert o["boxes"].shape == (0, 4) and o["masks"].shape == (0, 1, 64, 64)


def test_bad_targets_and_config_are_named():
    model = tiny().train()
    with pytest.raises(ValueError, match="targets are required"):
        model([torch.rand(3, 64, 64)])
    images, targets = sample_batch()
    del targets[1]["masks"]
    with pytest.raises(ValueError, match=r"targets\[1\] lacks 'masks'"):
        model(images, targets)
    for kw, msg in (({"backbone": "vgg"}, "backbone"), ({"mask_size": 24}, "mask_size"), ({"fpn": "x"}, "fpn"),
                    ({"num_classes": 1}, "num_classes"), ({"anchor_sizes": (8, 16)}, "anchor_sizes"),
                    # review (issue 35): each was accepted, and trained nothing or crashed later
                    ({"mask_samples": 0}, "mask_samples must be >= 1"),
                    ({"mask_iou_thresh": 1.5}, r"mask_iou_thresh must be in \[0, 1\)"),
                    ({"mask_iou_thresh": -0.1}, "mask_iou_thresh"),
                    ({"min_size": 0}, "min_size"), ({"min_size": 900, "max_size": 800}, "min_size <= max_size"),
                    ({"mask_margin": 0.8}, "mask_margin must be a finite number >= 1"),
                    ({"mask_frame": "box"}, "mask_frame"), ({"decoder_convs": -1}, "decoder_convs"),
                    ({"decoder_init": "xavier"}, "decoder_init must be 'scaled' or 'torch'"),
                    ({"num_classes": 4.0}, "num_classes")):
        with pytest.raises(ValueError, match=msg):
            SPRNetConfig(**kw)


def test_torchvision_style_builder_and_num_classes_shorthand(tmp_path):
    """``SPRNet(4)`` was an AttributeError on fpn_channels; torchvision users expect a builder by name."""
    assert SPRNet(4, **{k: v for k, v in SMALL.items() if k != "num_classes"}).config.num_classes == 4
    with pytest.raises(TypeError, match="SPRNetConfig or num_classes"):
        SPRNet("resnet50")
    with pytest.raises(TypeError, match="not both"):
        SPRNet(SPRNetConfig(**SMALL), fpn="sum")
    import torchvision

    src = torchvision.models.resnet50()
    torch.save(src.state_dict(), tmp_path / "r50.pth")
    model = sprnet_resnet50_fpn(num_classes=5, weights_backbone=str(tmp_path / "r50.pth"), min_size=64, max_size=64)
    assert model.config.num_classes == 5 and model.config.backbone == "resnet50"
    assert torch.equal(model.backbone.body.layer4[0].conv1.weight, src.layer4[0].conv1.weight)
    assert not model.backbone.body.layer1[0].conv1.weight.requires_grad    # 3 trainable stages, as torchvision
    model = sprnet_resnet50_fpn(num_classes=5, weights_backbone=src.state_dict(), trainable_backbone_layers=5)
    assert model.backbone.body.layer1[0].conv1.weight.requires_grad
    assert sprnet_resnet50_fpn().config.num_classes == 91
    with pytest.raises(ValueError, match="no pretrained SPRNet weights"):
        sprnet_resnet50_fpn(weights="COCO_V1")
    with pytest.raises(TypeError, match="sets 'backbone'"):
        sprnet_resnet50_fpn(backbone="resnet18")
    with pytest.raises(HpdlError, match="weights_backbone=.*no such file"):    # the argument the user passed
        sprnet_resnet50_fpn(num_classes=5, weights_backbone=str(tmp_path / "missing.pth"))


def test_default_is_the_papers_resnet50_gfpn_and_nothing_downloads(monkeypatch):
    import torch.hub

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", lambda *a, **k: pytest.fail("download attempted"))
    model = SPRNet(SPRNetConfig(num_classes=81))
    assert type(model.backbone.body.layer1[0]).__name__ == "Bottleneck"    # ResNet-50
    assert type(model.backbone.fpn).__name__ == "GatedFPN"
    assert model.enhance.out_channels == 640 and model.config.mask_size == 32
    assert model.decoder.predict.out_channels == 81                       # per-class masks
    assert 35e6 < model.num_parameters() < 45e6                           # RetinaNet R50 is 34.0M plus the branch


# ---------------------------------------------------------------- backbone

def test_backbone_weights_load_from_a_local_file_and_freeze_bn(tmp_path):
    import torchvision

    src = torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1])
    path = tmp_path / "r10.pth"
    torch.save(src.state_dict(), path)
    body = resnet_fpn("resnet10", out_channels=8, weights_path=str(path))
    assert torch.equal(body.body.conv1.weight, src.conv1.weight)
    assert type(body.body.bn1).__name__ == "FrozenBatchNorm2d"
    assert not body.body.layer1[0].conv1.weight.requires_grad and body.body.layer4[0].conv1.weight.requires_grad
    with pytest.raises(HpdlError, match="no such file"):
        resnet_fpn("resnet10", weights_path=str(tmp_path / "none.pth"))
    torch.save({"conv1.weight": src.conv1.weight}, tmp_path / "bad.pth")
    with pytest.raises(HpdlError, match="does not fit the ResNet: missing"):
        resnet_fpn("resnet10", weights_path=str(tmp_path / "bad.pth"))


def test_gated_fpn_keeps_the_pyramid_shapes():
    x = torch.rand(1, 3, 64, 64)
    plain = resnet_fpn("resnet10", out_channels=8)
    gated = resnet_fpn("resnet10", out_channels=8, gated=True)
    a, b = plain(x), gated(x)
    assert list(a) == list(b) and all(a[k].shape == b[k].shape for k in a)


# ---------------------------------------------------------------- sparse enhancement

@pytest.mark.parametrize("k,dilation", [(1, 1), (3, 1), (3, 2), (3, 6)])
def test_conv_at_equals_the_dense_conv_at_every_pixel(k, dilation):
    torch.manual_seed(0)
    x, w, bias = torch.randn(2, 5, 9, 7, dtype=torch.float64), torch.randn(4, 5, k, k, dtype=torch.float64), \
        torch.randn(4, dtype=torch.float64)
    dense = F.conv2d(x, w, bias, padding=dilation * (k // 2), dilation=dilation)
    b, y, xx = torch.meshgrid(torch.arange(2), torch.arange(9), torch.arange(7), indexing="ij")
    b, y, xx = b.flatten(), y.flatten(), xx.flatten()
    sparse = conv_at(x, w, bias, dilation, b, y, xx)
    torch.testing.assert_close(sparse, dense[b, :, y, xx], rtol=0, atol=1e-12)


def test_pixel_features_are_the_dense_enhancement_at_those_pixels():
    model = tiny().eval()
    torch.manual_seed(1)
    feats = [torch.randn(2, 16, 8, 8), torch.randn(2, 16, 4, 4), torch.randn(2, 16, 2, 2)]
    sizes = [64, 16, 4]
    pixels = torch.tensor([0, 63, 64, 70, 83, 80, 5, 79])
    b = torch.tensor([0, 1, 1, 0, 1, 0, 1, 1])
    got = model.pixel_features(feats, b, pixels)
    flat = torch.cat([model.enhance(f).flatten(2) for f in feats], 2)     # [B, C', sum HW]
    torch.testing.assert_close(got, flat[b, :, pixels], rtol=1e-5, atol=1e-5)
    assert sum(sizes) == flat.shape[-1]


def test_pixel_features_equal_the_per_level_conv_at_reference_with_gradients():
    """The one-gather version against the level-by-level conv_at one: values and gradients (float64)."""
    model = tiny().double()
    torch.manual_seed(2)
    feats = [torch.randn(3, 16, s, s + 1, dtype=torch.float64, requires_grad=True) for s in (8, 4, 2, 1)]
    total = sum(f.shape[-2] * f.shape[-1] for f in feats)
    pixels = torch.cat([torch.randint(0, total, (38,)), torch.tensor([total - 2, total - 1])])   # every level
    b = torch.randint(0, 3, (40,))
    got, ref = model.pixel_features(feats, b, pixels), model.pixel_features_reference(feats, b, pixels)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, feats + [model.enhance.point.weight], g)
    grads_ref = torch.autograd.grad(ref, feats + [model.enhance.point.weight], g)
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-10)
    assert model.pixel_features(feats, b[:0], pixels[:0]).shape == (0, model.enhance.out_channels)


# ---------------------------------------------------------------- positives

def test_spr_positives_against_a_brute_force_oracle_and_torchvision_matcher():
    from torchvision.models.detection.image_list import ImageList
    from torchvision.ops import box_iou

    gen = retina_anchors((8, 16, 32, 64, 128))
    feats = [torch.zeros(1, 1, s, s) for s in (8, 4, 2, 1, 1)]
    anchors = gen(ImageList(torch.zeros(1, 3, 64, 64), [(64, 64)]), feats)[0]
    boxes = torch.tensor([[4., 4, 30, 30], [28, 20, 60, 44], [50, 50, 53, 53]])   # the last fits no anchor well
    iou = box_iou(boxes, anchors)
    got, inst = spr_positives(iou, 0.5, max_samples=10_000)
    oracle = {k: int(iou[:, k].argmax()) for k in range(iou.shape[1]) if iou[:, k].max() > 0.5}
    for g in range(len(boxes)):   # each instance's best anchor
        oracle[int(iou[g].argmax())] = g
    assert dict(zip(got.tolist(), inst.tolist())) == oracle
    assert set(inst.tolist()) == {0, 1, 2} and len(got) > 3
    # where an anchor is positive by IoU, torchvision's Matcher (0.5, no low-quality) agrees on the instance
    matched = Matcher(0.5, 0.5, allow_low_quality_matches=False)(iou)
    for k, g in zip(got.tolist(), inst.tolist()):
        if matched[k] >= 0:
            assert matched[k] == g
    few, _ = spr_positives(iou, 0.5, max_samples=2)
    assert len(few) == 2 and set(few.tolist()) <= set(got.tolist())


# ---------------------------------------------------------------- encode / decode round trip

def test_encode_then_paste_recovers_a_box_mask_exactly():
    box = (10, 7, 41, 29)
    m = box_mask(48, 64, box)
    boxes = torch.tensor([box], dtype=torch.float32)
    for size in (8, 32):
        enc = encode_masks(m[None], boxes, size)
        assert enc.all()
        back = paste_masks(enc[:, None].float(), boxes, (48, 64))[0, 0] >= 0.5
        assert torch.equal(back, m.bool())


def test_encode_then_paste_recovers_a_disc_and_is_consistent_with_the_box_frame():
    m = disc(96, 96, 40.3, 51.7, 21.0)
    ys, xs = torch.nonzero(m, as_tuple=True)
    boxes = torch.tensor([[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]], dtype=torch.float32)
    back = paste_masks(encode_masks(m[None], boxes, 32)[:, None].float(), boxes, (96, 96))[0, 0] >= 0.5
    inter, union = (back & m.bool()).sum(), (back | m.bool()).sum()
    assert inter / union > 0.97
    # pasting into a shifted box shifts the mask by the same amount
    shifted = paste_masks(encode_masks(m[None], boxes, 32)[:, None].float(), boxes + 5, (96, 96))[0, 0] >= 0.5
    assert torch.equal(shifted[5:, 5:], back[:-5, :-5])


def test_a_mask_encoded_at_a_pixel_decodes_back():
    """The SPR round trip: one pixel's feature vector, through the decoder, reconstructs the instance's mask
    (training the decoder on that single pixel), pasted back into the instance's box."""
    torch.manual_seed(0)
    m = disc(64, 64, 30, 34, 17)
    ys, xs = torch.nonzero(m, as_tuple=True)
    box = torch.tensor([[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]], dtype=torch.float32)
    target = encode_masks(m[None], box, 32)
    vec = torch.randn(1, 24)
    dec = SPRDecoder(24, num_masks=3, mask_size=32, channels=(16, 8))
    opt = torch.optim.Adam(dec.parameters(), lr=1e-2)
    for _ in range(150):
        loss = spr_mask_loss(dec(vec)[:, 2], target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    probs = torch.sigmoid(dec(vec)[:, 2:3]).detach()
    back = paste_masks(probs, box, (64, 64))[0, 0] >= 0.5
    assert (back & m.bool()).sum() / (back | m.bool()).sum() > 0.95


@pytest.mark.parametrize("mask_size,convs,anchors,init,frame", [(8, 0, 0, "torch", False), (16, 0, 0, "scaled", False),
                                                                (32, 0, 0, "torch", False), (32, 1, 9, "scaled", True),
                                                                (16, 2, 3, "torch", True)])
def test_decoder_matrix_products_equal_the_convolution_modules(mask_size, convs, anchors, init, frame):
    """The quad-tree matrix-product decoder is the deconvolution stack, all channels and one, with and without
    the 3x3 convolutions and the anchor and frame conditioning."""
    torch.manual_seed(3)
    dec = SPRDecoder(24, num_masks=5, mask_size=mask_size, channels=(16, 8), convs=convs,
                     num_anchors=anchors, init=init, frame_conditioning=frame).double()
    assert sum(isinstance(m, torch.nn.Conv2d) for m in dec.up) == 2 * convs
    v = torch.randn(6, 24, dtype=torch.float64)
    a = torch.tensor([0, 1, 2, 0, 1, 2]) if anchors else None
    f = torch.randn(6, 4, dtype=torch.float64) if frame else None
    if anchors:
        with torch.no_grad():   # zero at init (the paper's decoder); random here, so it matters
            dec.anchor_scale.weight.normal_()
            dec.anchor_shift.weight.normal_()
        assert not torch.allclose(dec(v, a, f), dec(v, torch.zeros_like(a), f))
        with pytest.raises(ValueError, match="conditioned on anchors"):
            dec(v, None, f)
    if frame:
        assert torch.equal(dec(v, a, f), dec(v, a, torch.zeros_like(f)))   # no effect at init (zero last layer)
        with torch.no_grad():
            dec.frame_film[2].weight.normal_()
        assert not torch.allclose(dec(v, a, f), dec(v, a, torch.zeros_like(f)))
        with pytest.raises(ValueError, match="conditioned on the mask frame"):
            dec(v, a)
    ref = dec.reference(v, a, f)
    torch.testing.assert_close(dec(v, a, f), ref, rtol=0, atol=1e-12)
    channel = torch.tensor([0, 4, 2, 2, 1, 3])
    torch.testing.assert_close(dec.forward_channels(v, channel, a, f), ref[torch.arange(6), channel], rtol=0,
                               atol=1e-12)


def test_scaled_init_keeps_the_vector_in_the_logits():
    """Under PyTorch's default init the chain of 2x2 deconvolutions shrank the logits' spread across input
    vectors to ~0.004 for unit-scale inputs (the decoder ignored its input at the start); the scaled init
    keeps it at ~0.3."""
    torch.manual_seed(0)
    v = torch.relu(torch.randn(64, 640))
    spread = {}
    for init in ("torch", "scaled"):
        dec = SPRDecoder(640, 4, 32, (256, 128), num_anchors=9, convs=1, init=init)
        with torch.no_grad():
            spread[init] = float(dec(v, torch.zeros(64, dtype=torch.long)).std(0).mean())   # across vectors
    assert spread["torch"] < 0.01 < 0.1 < spread["scaled"] < 2.0, spread


def test_training_loss_and_gradients_equal_the_previous_implementation():
    """The vectorised SPR branch (one gather, matrix-product decoder, only the label channel) gives the same
    losses and gradients as the previous one (per-level conv_at, deconvolution modules, all K channels)."""
    images, targets = sample_batch()

    def run(old: bool):
        model = tiny(mask_samples=10_000).double().train()
        if old:
            def mask_logits(features, b, anchors, labels, frames):
                a = model.num_anchors
                logits = model.decoder.reference(model.pixel_features_reference(features, b, anchors // a),
                                                 anchors % a, frames)
                return logits[torch.arange(len(labels)), labels]
            model.mask_logits = mask_logits
        losses = model([im.double() for im in images], [dict(t, boxes=t["boxes"].double()) for t in targets])
        sum(losses.values()).backward()
        return ({k: float(v.detach()) for k, v in losses.items()},
                [p.grad for p in (model.decoder.predict.weight, model.decoder.linear[0].weight,
                                  model.enhance.dilated[2].weight, model.backbone.fpn.layer_blocks[0][0].weight)])

    new, old = run(False), run(True)
    assert new[0].keys() == old[0].keys() and new[0]["mask"] > 0.1
    for k in new[0]:
        assert math.isclose(new[0][k], old[0][k], rel_tol=1e-10), (k, new[0][k], old[0][k])
    for a, r in zip(new[1], old[1]):
        torch.testing.assert_close(a, r, rtol=1e-8, atol=1e-12)


def test_decoder_output_shapes():
    v = torch.randn(5, 40)
    assert SPRDecoder(40, 7, 32, (16, 8))(v).shape == (5, 7, 32, 32)
    assert SPRDecoder(40, 1, 16, (16, 8))(v).shape == (5, 1, 16, 16)
    assert SPRDecoder(40, 2, 32, (16, 8))(v[:0]).shape == (0, 2, 32, 32)
    assert SPRDecoder(40, 2, 32, (16, 8), convs=1, num_anchors=9)(v[:0], torch.zeros(0, dtype=torch.int64)).shape \
        == (0, 2, 32, 32)
    assert MaskEnhancement(16, (16, 8)).out_channels == 40


# ---------------------------------------------------------------- losses

def _perfect_outputs(model, images, targets):
    """Head outputs and mask logits that predict the assignments exactly (logits +-30)."""
    model.train()
    imgs, tgts = model.transform(images, targets)
    feats = list(model.backbone(imgs.tensors).values())
    anchors = model.anchor_generator(imgs, feats)
    matched, _ = model.assign(tgts, anchors)
    heads = model.head(feats)
    cls = torch.full_like(heads["cls_logits"], -30.0)
    reg = torch.zeros_like(heads["bbox_regression"])
    for i, (m, t) in enumerate(zip(matched, tgts)):
        fg = torch.where(m >= 0)[0]
        cls[i, fg, t["labels"][m[fg]]] = 30.0
        reg[i, fg] = model.box_coder.encode_single(t["boxes"][m[fg]], anchors[i][fg])
    _, spr = model.assign(tgts, anchors, reg, imgs.image_sizes)   # the mask frames of these boxes
    return tgts, anchors, matched, spr, {"cls_logits": cls, "bbox_regression": reg}, feats


def test_loss_is_zero_for_perfect_predictions_and_positive_otherwise():
    model = tiny(mask_samples=10_000)
    images, targets = sample_batch()
    with torch.no_grad():
        tgts, anchors, matched, spr, perfect, feats = _perfect_outputs(model, images, targets)
        assert len(spr["anchor"]) >= 3 and all((m >= 0).any() for m in matched)
        head = model.head.compute_loss(tgts, perfect, anchors, matched)
        mask = spr_mask_loss(30.0 * (2 * spr["mask"].float() - 1), spr["mask"])
        assert head["classification"] < 1e-10 and head["bbox_regression"] < 1e-6 and mask < 1e-10
        worse = dict(perfect, bbox_regression=perfect["bbox_regression"] + 0.1)
        assert model.head.compute_loss(tgts, worse, anchors, matched)["bbox_regression"] > 0.1
        assert spr_mask_loss(torch.zeros_like(spr["mask"], dtype=torch.float32), spr["mask"]) > 0.5
        # the model's own loss, with the decoder replaced by one that outputs the targets, is zero too
        logits = 30.0 * (2 * spr["mask"].float() - 1)
        model.mask_logits = lambda f, b, p, lab, frames: logits
        losses = model.compute_loss(tgts, perfect, anchors, feats, [(64, 64), (48, 80)])
        assert all(v < 1e-6 for v in losses.values()), losses


def test_mask_targets_are_the_instances_masks_in_their_boxes():
    model = tiny(mask_samples=10_000, mask_frame="gt", mask_margin=1.0)   # the paper's frame
    images, targets = sample_batch()
    with torch.no_grad():
        tgts, _, _, spr, _, _ = _perfect_outputs(model, images, targets)
    # instance 1 of image 0 is a box mask: its 32x32 target is all ones; the discs are not
    lab = spr["label"]
    assert spr["mask"][lab == 3].all() and not spr["mask"][lab == 1].all()
    disc_fill = spr["mask"][lab == 1].float().mean()
    assert abs(disc_fill - math.pi / 4) < 0.05    # a disc fills pi/4 of its box


def test_mask_targets_live_in_the_enlarged_predicted_box_that_inference_pastes_into():
    """One frame (issue 35): a target is the instance's mask cropped to its anchor's decoded box (detached)
    enlarged mask_margin (1.2x); pasting the target back into that frame gives the instance's mask, wherever the
    box is."""
    model = tiny(mask_samples=10_000)
    assert model.config.mask_margin == 1.2
    images, targets = sample_batch()
    with torch.no_grad():
        imgs, tgts = model.transform(images, targets)
        feats = list(model.backbone(imgs.tensors).values())
        anchors = model.anchor_generator(imgs, feats)
        reg = torch.randn_like(model.head(feats)["bbox_regression"]) * 0.2     # imperfect boxes
        _, spr = model.assign(tgts, anchors, reg, imgs.image_sizes)
    assert len(spr["anchor"]) >= 4
    from torchvision.ops import clip_boxes_to_image

    for k in range(len(spr["anchor"])):
        i, a = int(spr["image"][k]), int(spr["anchor"][k])
        box = clip_boxes_to_image(model.box_coder.decode_single(reg[i, a:a + 1], anchors[i][a:a + 1]),
                                  imgs.image_sizes[i])
        frame = mask_frame(box, model.config.mask_margin)
        # the decoder is told that box, as the box coder's deltas from the anchor
        torch.testing.assert_close(spr["frame"][k], model.box_coder.encode_single(box, anchors[i][a:a + 1])[0])
        g = int((tgts[i]["labels"] == spr["label"][k]).nonzero()[0, 0])    # labels are unique in each image
        assert torch.equal(spr["mask"][k], encode_masks(tgts[i]["masks"], frame, 32, torch.tensor([g]))[0])
        h, w = imgs.image_sizes[i]
        back = paste_masks(spr["mask"][k][None, None].float(), frame, (h, w))[0, 0] >= 0.5
        truth = tgts[i]["masks"][g].bool()
        inside = paste_masks(torch.ones(1, 1, 32, 32), frame, (h, w))[0, 0] > 0   # the frame's pixels
        assert (truth & inside).sum() > 50
        iou = (back & truth & inside).sum() / ((back | truth) & inside).sum()
        assert iou > 0.8, (k, float(iou))
    # the frame is the enlarged box: a 10x20 box at 1.2 is 12x24 about the same centre
    torch.testing.assert_close(mask_frame(torch.tensor([[10., 20, 20, 40]]), 1.2), torch.tensor([[9., 18, 21, 42]]))


def test_inference_tells_the_decoder_the_detected_box_as_training_does():
    """The decoder's frame input at inference is the detected (clipped) box relative to its anchor, the same
    quantity training gives it for the anchor's decoded box."""
    model = tiny(score_thresh=0.0, detections_per_img=5).eval()
    seen, detect, decode = {}, model.detect, model.decoder.forward_channels

    def spy_detect(*args):
        dets, pixels = detect(*args)
        seen["boxes"], seen["anchor"] = dets[0]["boxes"].clone(), pixels[0]
        return dets, pixels

    def spy_decode(v, channel, anchor=None, frame=None):
        seen["frame"] = frame
        return decode(v, channel, anchor, frame)

    model.detect, model.decoder.forward_channels = spy_detect, spy_decode
    image = torch.rand(3, 64, 64)
    with torch.no_grad():
        model([image])
        imgs, _ = model.transform([image])
        anchors = model.anchor_generator(imgs, list(model.backbone(imgs.tensors).values()))[0][seen["anchor"]]
    assert len(seen["boxes"]) == 5 and seen["frame"].shape == (5, 4)
    torch.testing.assert_close(model.box_coder.decode_single(seen["frame"], anchors), seen["boxes"])
    assert tiny(frame_conditioning=False).frame_deltas(seen["boxes"], anchors) is None


def test_inference_pastes_into_the_enlarged_detected_box():
    model = tiny(score_thresh=0.0, detections_per_img=5).eval()
    captured = {}
    paste = model.transform.postprocess

    def spy(result, sizes, originals):
        captured["masks"] = [r["masks"].clone() for r in result]
        return paste(result, sizes, originals)

    model.transform.postprocess = spy
    with torch.no_grad():
        out = model([torch.rand(3, 64, 64)])[0]
    expect = paste_masks(captured["masks"][0], mask_frame(out["boxes"], model.config.mask_margin), (64, 64))
    torch.testing.assert_close(out["masks"], expect)


def test_bf16_autocast_trains_and_infers_with_fp32_outputs():
    model = tiny(score_thresh=0.0, detections_per_img=5)
    images, targets = sample_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = model.train()(images, targets)
        assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in losses.values())
        with torch.no_grad():
            out = model.eval()(images)
    assert out[0]["masks"].dtype == torch.float32 and out[0]["masks"].shape == (5, 1, 64, 64)


def test_detections_match_torchvision_retinanet_postprocessing():
    """SPRNet's boxes, scores and labels are RetinaNet's: the same weights through torchvision's
    ``RetinaNet.forward`` give the same detections."""
    from torchvision.models.detection import RetinaNet

    model = tiny(score_thresh=0.02, topk_candidates=50, detections_per_img=20).eval()
    with torch.no_grad():        # spread the scores over classes, levels and positions: the head's std-0.01 init
        torch.manual_seed(5)     # leaves every position at its bias, and among equal scores the order is moot
        model.head.classification_head.cls_logits.bias.normal_(-3, 1.0)
        for m in model.head.classification_head.modules():
            if isinstance(m, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(m.weight)
        images, _ = sample_batch()
        ours = model(images)
        theirs = RetinaNet.forward(model, images)
    def rows(d):   # equal scores may come in either order: compare the sorted (score, label, box) rows
        r = torch.cat([d["scores"][:, None], d["labels"][:, None].float(), d["boxes"]], 1)
        for col in reversed(range(r.shape[1])):
            r = r[r[:, col].argsort(stable=True)]
        return r

    for a, b in zip(ours, theirs):
        assert len(a["boxes"]) > 5
        torch.testing.assert_close(a["scores"], b["scores"])
        torch.testing.assert_close(rows(a), rows(b))


@pytest.mark.parametrize("edit, msg", [
    (lambda t: t["boxes"].__setitem__((1, 0), 70.0), r"targets\[0\]\['boxes'\]\[1\].*positive width"),   # x1 > x2
    (lambda t: t["boxes"].__setitem__((0, 3), 10.0), r"targets\[0\]\['boxes'\]\[0\].*positive width"),   # y2 = y1
    (lambda t: t.__setitem__("masks", t["masks"][:1]), r"targets\[0\]\['masks'\] must be \[2, 64, 64\]"),
    (lambda t: t.__setitem__("masks", t["masks"][:, :32, :32]), r"targets\[0\]\['masks'\] must be \[2, 64, 64\]"),
    (lambda t: t.__setitem__("labels", torch.tensor([1, 4])), r"targets\[0\]\['labels'\] must be in 1\.\.3"),
    (lambda t: t.__setitem__("labels", torch.tensor([0, 2])), r"targets\[0\]\['labels'\] must be in 1\.\.3.*background"),
    (lambda t: t.__setitem__("labels", torch.tensor([1., 2.])), r"targets\[0\]\['labels'\] must be an integer"),
    (lambda t: t["boxes"].__setitem__((0, 0), float("nan")), r"targets\[0\]\['boxes'\]\[0\].*finite"),  # segfaulted
    (lambda t: t["boxes"].__setitem__((1, 2), float("inf")), r"targets\[0\]\['boxes'\]\[1\].*finite"),
    (lambda t: t.__setitem__("labels", torch.tensor([1])), r"targets\[0\]\['labels'\] must be \[2\]"),
    (lambda t: t.__setitem__("boxes", t["boxes"].long()), "float tensor"),
    # review (issue 35): each of these trained on garbage silently
    (lambda t: t["masks"][1].zero_(), r"targets\[0\]\['masks'\]\[1\] is all zero"),
    (lambda t: t.__setitem__("boxes", t["boxes"] + torch.tensor([70., 0, 70, 0])),
     r"targets\[0\]\['boxes'\]\[0\].*entirely outside the 64x64 image"),
    (lambda t: t.__setitem__("masks", t["masks"].float() * 0.4), r"targets\[0\]\['masks'\] must be uint8 or bool"),
])
def test_malformed_targets_are_rejected_not_trained_on(edit, msg):
    """An inverted box gave a NaN box loss and a missing mask an out-of-bounds roi_align read, silently."""
    model = tiny().train()
    images, targets = sample_batch()
    edit(targets[0])
    with pytest.raises(ValueError, match=msg):
        model(images, targets)


def test_images_and_targets_must_pair_up_and_be_rgb_or_grey():
    """Fewer targets than images was an IndexError, more were silently ignored; a 4-channel image failed inside
    torchvision's normalisation with a broadcasting error; an empty list with an IndexError."""
    model = tiny().train()
    images, targets = sample_batch()
    with pytest.raises(ValueError, match="one dict per image: 2 images, 1 targets"):
        model(images, targets[:1])
    with pytest.raises(ValueError, match="one dict per image: 1 images, 2 targets"):
        model(images[:1], targets)
    with pytest.raises(ValueError, match=r"images\[1\] must be \[3, H, W\].*got \[4, 48, 80\]"):
        model([images[0], torch.rand(4, 48, 80)], targets)
    assert set(model([images[0][:1]], targets[:1])) == {"classification", "bbox_regression", "mask"}   # grey
    model.eval()
    with pytest.raises(ValueError, match="images is empty"):
        model([])
    with pytest.raises(ValueError, match=r"images\[0\] must be"):
        model([torch.rand(2, 64, 64)])
    nan = torch.rand(3, 64, 64)
    nan[0, 3, 3] = float("nan")
    with pytest.raises(ValueError, match=r"images\[1\] has NaN"):   # returned 0 detections silently
        model([torch.rand(3, 64, 64), nan])
    model.train()
    with pytest.raises(ValueError, match=r"images\[1\] has NaN"):   # a NaN loss, skipped by fit
        model([images[0], nan], targets)
    model.eval()
    with pytest.raises(ValueError, match=r"images\[0\] is 300x2 pixels.*under one pixel"):   # interpolate crashed
        model([torch.rand(3, 2, 300)])
    with pytest.raises(ValueError, match=r"images\[0\] must be a float tensor"):
        model([torch.zeros(3, 64, 64, dtype=torch.uint8)])


def test_encode_masks_rejects_non_finite_boxes_and_paste_takes_an_empty_image():
    m = box_mask(64, 64, (10, 10, 30, 30))[None]
    with pytest.raises(ValueError, match="boxes must be finite"):
        encode_masks(m, torch.tensor([[float("nan"), 10.0, 30.0, 30.0]]), 8)   # was a segfault in roi_align
    assert paste_masks(torch.rand(1, 1, 8, 8), torch.tensor([[1.0, 1, 5, 5]]), (0, 64)).shape == (1, 1, 0, 64)


@pytest.mark.parametrize("field, value", [
    ("mask_size", 8.0), ("frame_conditioning", "no"), ("anchor_conditioning", 1),
    ("anchor_sizes", (0, 64, 128, 256, 512)),
    ("fpn_channels", 0), ("enhance_channels", (16,)), ("decoder_channels", (0, 8)), ("decoder_convs", 1.5),
    ("mask_samples", 2.5), ("detections_per_img", float("nan"))])
def test_bad_config_types_and_sizes_are_named(field, value):
    # these were a bare TypeError/IndexError/ZeroDivisionError deep in the build, or accepted ("no" was True)
    with pytest.raises(ValueError, match=field):
        SPRNetConfig(**{field: value})
