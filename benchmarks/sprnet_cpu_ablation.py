"""CPU ablation of SPRNet's mask branch: train on a tiny shapes set, print box and mask AP (evidence, not goals).

The setting of the CI test (ResNet-10-FPN, FPN width 32, 64 px, 16 training images of 1-2 large shapes,
300 steps at batch 8, lr 2e-3, evaluated on the training images: it measures how well the model *fits*), or
with ``--val`` 160 training and 40 held-out images. One JSON line on stdout. About a minute of CPU.

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
    m.pop("predictions")
    print(json.dumps({"overrides": over, "seed": args.seed, "steps": args.steps, "val": args.val,
                      "train_cpu_s": round(cpu, 1), "losses": stats["losses"],
                      "segm": {k: round(100 * v, 1) for k, v in m["segm"].items()},
                      "bbox": {k: round(100 * v, 1) for k, v in m["bbox"].items()}}))


if __name__ == "__main__":
    main()
