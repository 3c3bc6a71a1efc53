"""CPU ablation of SPRNet's mask branch: train on a tiny shapes set, print box and mask AP (evidence, not goals).

The setting of the CI test (ResNet-10-FPN, FPN width 32, 64 px, 16 training images of 1-2 large shapes,
300 steps at batch 8, lr 2e-3, evaluated on the training images: it measures how well the model *fits*), or
with ``--val`` 160 training and 40 held-out images. One JSON line on stdout. About a minute of CPU.

Besides COCO AP (which on ~25 instances swings with the detector from seed to seed) it prints ``mask_iou``:
for each ground-truth instance, the mask IoU of the best-scoring detection of its class whose box overlaps its
box at IoU >= 0.5 (a measure of the masks given the detections), their mean, and ``matched`` instances.

    PYTHONPATH=src nice python3 benchmarks/sprnet_cpu_ablation.py --seed 1                       # defaults
    PYTHONPATH=src nice python3 benchmarks/sprnet_cpu_ablation.py '{"mask_frame": "gt", "mask_margin": 1.0}'
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def main() -> None:
    from torch.utils.data import DataLoader

    from hpdl.vision import detect
    from hpdl.vision.coco import CocoInstances, collate
    from hpdl.vision.shapes import ShapesConfig, make_shapes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="?", default="{}", help="SPRNetConfig fields as JSON (default: none)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val", action="store_true", help="160 train / 40 held-out val images instead of fitting 16")
    args = p.parse_args()
    over = json.loads(args.overrides)
    torch.set_num_threads(1)   # the same arithmetic whatever the machine's load
    root = tempfile.mkdtemp(prefix="sprnet_ablation_")
    make_shapes(root, ShapesConfig(num_train=160 if args.val else 16, num_val=40 if args.val else 4, image_size=64,
                                   max_instances=2, min_scale=0.3, max_scale=0.6, seed=1 if args.val else 0))
    ds = CocoInstances(root, "train", train=True, cache=True)
    ev = CocoInstances(root, "val" if args.val else "train", cache=True)
    torch.manual_seed(args.seed)
    model = detect.build_model("sprnet", ds.num_classes, backbone="resnet10", image_size=64, fpn_channels=32,
                               anchor_sizes=(16, 32, 64, 128, 256), enhance_channels=(32, 16),
                               decoder_channels=(32, 16), **over)
    loader = DataLoader(ds, batch_size=8, shuffle=True, collate_fn=collate, drop_last=True)
    t = time.process_time()
    stats = detect.fit(model, loader, steps=args.steps, lr=2e-3, warmup_steps=10, device="cpu", progress=False)
    cpu = time.process_time() - t
    m = detect.evaluate_model(model, ev, device="cpu", progress=False)
    ious = matched_mask_ious(ev, m.pop("predictions"))
    print(json.dumps({"overrides": over, "seed": args.seed, "steps": args.steps, "val": args.val,
                      "train_cpu_s": round(cpu, 1), "losses": stats["losses"],
                      "mask_iou": round(sum(ious) / max(1, len(ious)), 4), "matched": len(ious),
                      "segm": {k: round(100 * v, 1) for k, v in m["segm"].items()},
                      "bbox": {k: round(100 * v, 1) for k, v in m["bbox"].items()}}))


def matched_mask_ious(dataset, predictions) -> list[float]:
    """Per ground-truth instance with a match: the mask IoU of the best-scoring same-class detection whose box
    IoU with the instance's is >= 0.5 (``predictions`` as :func:`hpdl.vision.detect.predict` in dataset order)."""
    from torchvision.ops import box_iou

    ious = []
    for k, (_, out) in enumerate(predictions):
        _, target = dataset[k]
        for g in range(len(target["boxes"])):
            ok = (out["labels"] == target["labels"][g]) & (box_iou(target["boxes"][g:g + 1], out["boxes"])[0] >= 0.5)
            if ok.any():
                best = int(torch.where(ok, out["scores"], -1.0).argmax())
                pred, truth = out["masks"][best, 0], target["masks"][g].bool()
                ious.append(float((pred & truth).sum() / (pred | truth).sum().clamp(min=1)))
    return ious


if __name__ == "__main__":
    main()
