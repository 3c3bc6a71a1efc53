"""Rank functions for the data-parallel classification test (spawned ranks import them by name)."""

from __future__ import annotations

import torch

MICRO = dict(embed_dims=(16, 32, 48, 64), num_heads=(2, 2, 3, 4), depths=(1, 1, 1, 1), stem_channels=8,
             sr_ratios=(2, 2, 1))


def ddp_fit(ctx, steps: int):
    from hpdl.models.soft import SoftConfig, SoftViT
    from hpdl.vision.classify import TrainConfig, fit
    from hpdl.vision.datasets import Shapes, classification_transforms

    tf = classification_transforms(32, False)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = SoftViT(SoftConfig(img_size=32, num_classes=3, **MICRO))
    res = fit(model, Shapes(48, 32, 3, seed=0, transform=tf), Shapes(11, 32, 3, seed=1, transform=tf),
              TrainConfig(epochs=1, batch_size=4, max_steps=steps, device="cpu", workers=0, progress=False))
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"params": flat, "steps": res["steps"], "val_images": res["final"]["images"],
            "val_top1": res["final"]["top1"]}
