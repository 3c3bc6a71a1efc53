"""Device benchmark of SPRNet against its anchors: SPRNet, Mask R-CNN and RetinaNet (ResNet-50-FPN, random init,
nothing downloaded) trained with the same schedule on a generated shapes set, then box/mask AP (pycocotools) on
its val split, and inference images/s at the same input size (SPRNet vs Mask R-CNN, RetinaNet for reference).

Goals (issue 35; both models from scratch, same backbone, equal steps, one run):
- mask AP >= Mask R-CNN's - 1.0, and AP75 and APs within 2 points of it;
- box AP >= RetinaNet's + 1.0 at every scale (APs, APm, APl);
- inference images/s at batch 1 and 8 with the trained weights (same resize, same detection caps: score 0.05,
  100 detections) >= 1.3x Mask R-CNN's (torchvision's as shipped, and with SPRNet's batched paste).

Launch (repository root; results land in --out, else $OUT, else ./out/sprnet_device; pycocotools must be
importable):
    PYTHONPATH=src python3 benchmarks/sprnet_device.py                   # 1 x H200, about 8 minutes (480 s)
    PYTHONPATH=src python3 benchmarks/sprnet_device.py --budget-s 200    # shorter: fewer training steps
    PYTHONPATH=src python3 benchmarks/sprnet_device.py --data /coco      # a COCO-layout set instead of shapes
    PYTHONPATH=src python3 benchmarks/sprnet_device.py --smoke           # CPU, tiny, a minute or two

The three models train in lock-step: each takes step k on the same batch before any takes step k + 1, so all
have the same number of steps whatever the time does. The count is planned to fill the budget (less the
reserve for evaluation and timing, capped at --max-steps) from step times measured on throw-away copies, and
re-planned from the measured lock-step time when the warm-up ends and at 60% of the plan (a from-scratch
Mask R-CNN's first steps are its cheapest); or exactly --steps. At the training deadline all models stop at
the same step (the JSON says so) and the timing phase shrinks its repeats rather than overrun the budget.

Writes $OUT/sprnet_device.json (everything), sprnet_device.png (AP and images/s bars), sprnet_masks.png and
maskrcnn_masks.png (predicted masks over val images), sprnet_device.log (the progress lines), and prints the
tables last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

# ---- defaults (one visible block) ----
@dataclass
class Settings:
    budget_s: float = 480.0        # whole run, data generation included (plus ~15 s of start-up outside it)
    data: str = ""                 # COCO-layout folder; empty: generate shapes
    out: str = ""                  # results folder; empty: $OUT, or ./out/sprnet_device without it
    train_images: int = 2000
    val_images: int = 300
    image_size: int = 256          # shapes are drawn at this size, and the models take it as input
    backbone: str = "resnet50"
    fpn_channels: int = 256
    batch_size: int = 16
    lr: float = 5e-4               # AdamW; linear warm-up then cosine to 0
    warmup_steps: int = 200
    steps: int = 0                 # training steps of every model; 0: as many as the budget allows (calibrated)
    max_steps: int = 4000
    min_steps: int = 100           # below this the run says the budget is too small (it still runs)
    eval_reserve_s: float = 12.0   # kept for each model's evaluation (5 s each on the H200, 2026-12-04)
    timing_reserve_s: float = 40.0
    mask_iou_thresh: float = 0.5   # SPRNet's (SPRNetConfig.mask_iou_thresh); the paper's is 0.7
    mask_frame: str = "predicted"  # SPRNetConfig.mask_frame: "predicted" (issue 35) or "gt" (the paper's)
    mask_margin: float = 1.2       # SPRNetConfig.mask_margin
    decoder_convs: int = 1         # SPRNetConfig.decoder_convs (0: the paper's decoder)
    cudnn_benchmark: bool = False  # the heads see a new batch size every step (positives, RoIs): see below
    timing_batches: str = "1,8"    # images per inference call; the first is the goal's
    seed: int = 0
    smoke: bool = False


SMOKE = {"budget_s": 240.0, "train_images": 16, "val_images": 4, "image_size": 64, "backbone": "resnet10",
         "fpn_channels": 32, "batch_size": 4, "lr": 2e-3, "warmup_steps": 5, "max_steps": 8, "min_steps": 2,
         "eval_reserve_s": 15.0, "timing_reserve_s": 20.0, "timing_batches": "1,2"}
MODELS = ("sprnet", "maskrcnn", "retinanet")
FIRST_PLAN_SLACK = 1.5      # calibrated step time x this for the first plan (see the calibration)
REPLAN_FILL = 0.93          # share of the measured time left that the re-plan fills with steps
CURVE_POINTS = 50           # loss curves in the JSON: window means, about this many points a loss
MIN_ANCHOR_AP_POINTS = 5.0  # Mask R-CNN mask AP and RetinaNet box AP, below which the AP goals are void
AP_COLUMNS = ("AP", "AP50", "AP75", "APs", "APm", "APl")
LOG_FILE: Path | None = None


def parse() -> Settings:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    for f in fields(Settings):
        if f.type in ("bool", bool):
            p.add_argument(f"--{f.name.replace('_', '-')}", action="store_true")
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None)
    args = p.parse_args()
    given = {k: v for k, v in vars(args).items() if v not in (None, False)}
    base = {**(SMOKE if given.get("smoke") else {}), **given}
    return Settings(**base)


def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, file=sys.stderr, flush=True)
    if LOG_FILE is not None:
        with open(LOG_FILE, "a") as f:
            f.write(line + "\n")


def main() -> int:
    from torch.utils.data import DataLoader

    from hpdl.bench.common import run_metadata
    from hpdl.vision import detect
    from hpdl.vision.coco import CocoInstances, collate
    from hpdl.vision.shapes import ShapesConfig, make_shapes

    s = parse()
    t_start = time.monotonic()
    deadline = t_start + s.budget_s
    out = Path(s.out or os.environ.get("OUT", "out/sprnet_device"))
    out.mkdir(parents=True, exist_ok=True)
    global LOG_FILE
    LOG_FILE = out / "sprnet_device.log"
    LOG_FILE.write_text("")
    log(f"settings {json.dumps(asdict(s))}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = detect.resolve_device("cpu" if s.smoke else "auto")
    # cuDNN's benchmark mode re-tunes every convolution for every new input shape. The number of positive pixels
    # (SPRNet) and of positive RoIs (Mask R-CNN's mask head) changes every step, so in that mode the mask branches
    # re-tune nearly every step (the first device run: SPRNet 1.86 s a step, Mask R-CNN 0.71 s, RetinaNet 0.11 s)
    torch.backends.cudnn.benchmark = s.cudnn_benchmark
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    result = run_metadata(device=device.type, versions=("torchvision",), settings=asdict(s), phases_s={})

    # ---- data
    tmp = None
    if s.data:
        root = Path(s.data)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="sprnet_shapes_")
        root = Path(tmp.name)
        cfg = ShapesConfig(num_train=s.train_images, num_val=s.val_images, image_size=s.image_size, seed=s.seed)
        t = time.monotonic()
        make_shapes(root, cfg, workers=0 if s.smoke else min(16, os.cpu_count() or 1))
        result["shapes"] = {**asdict(cfg), "classes": list(cfg.classes)}
        log(f"shapes: {s.train_images} + {s.val_images} images of {s.image_size} px in {time.monotonic() - t:.1f} s")
    cache = not s.data
    train_ds = CocoInstances(root, "train", train=True, cache=cache)
    val_ds = CocoInstances(root, "val", cache=cache)
    if cache:
        for ds in (train_ds, val_ds):
            for i in range(len(ds)):
                ds[i]
    result["phases_s"]["data"] = time.monotonic() - t_start
    workers = 0 if cache else 8
    loader = DataLoader(train_ds, batch_size=s.batch_size, shuffle=True, num_workers=workers, collate_fn=collate,
                        drop_last=True, pin_memory=device.type == "cuda", persistent_workers=workers > 0)

    def build(name: str):
        torch.manual_seed(s.seed)
        extra = {"mask_iou_thresh": s.mask_iou_thresh, "mask_frame": s.mask_frame, "mask_margin": s.mask_margin,
                 "decoder_convs": s.decoder_convs} if name == "sprnet" else {}
        return detect.build_model(name, train_ds.num_classes, backbone=s.backbone, image_size=s.image_size,
                                  fpn_channels=s.fpn_channels, **extra)

    # ---- calibrate: seconds a step, on throw-away copies (the first plan; re-planned when the warm-up ends)
    t = time.monotonic()
    step_s = {}
    for name in MODELS:
        model = build(name)
        detect.fit(model, loader, steps=2, lr=s.lr, device=device, progress=False)
        t1 = time.monotonic()
        detect.fit(model, loader, steps=4, lr=s.lr, device=device, progress=False)
        step_s[name] = (time.monotonic() - t1) / 4
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["phases_s"]["calibrate"] = time.monotonic() - t
    reserve = len(MODELS) * s.eval_reserve_s + s.timing_reserve_s
    train_deadline = deadline - reserve
    train_budget = train_deadline - time.monotonic()
    # a from-scratch Mask R-CNN's first steps are its cheapest (few positive RoIs for the mask head): in the
    # 2026-12-04 run its steps took 1.8x the calibrated time. The first plan allows for that; the re-plan
    # measures the real lock-step time
    planned = s.steps or int(min(s.max_steps, max(0.0, train_budget) / (FIRST_PLAN_SLACK * sum(step_s.values()))))
    planned = max(planned, 1)
    # re-plans: when the warm-up ends (the lr's peak: changing the cosine's length there barely moves the lr),
    # and at 60% of that plan, each from the lock-step time measured since the previous point
    replan_at = 0 if s.steps else max(2, min(s.warmup_steps, planned // 2))
    log(f"step s {json.dumps({k: round(v, 4) for k, v in step_s.items()})}: first plan {planned} steps each "
        f"(train budget {train_budget:.0f} s){'' if s.steps else f', re-planned at step {replan_at}'}")

    # ---- train in lock-step: every model takes step k, on the same batch, before any takes step k + 1, so all
    # have the same number of steps whatever the time does (same batches, lr schedule, seed)
    models = {name: build(name) for name in MODELS}
    result["sprnet_config"] = asdict(models["sprnet"].config)
    trainers = {name: detect.Trainer(models[name], loader, steps=planned, lr=s.lr, warmup_steps=s.warmup_steps,
                                     device=device, progress=False, label=f"train {name}") for name in MODELS}
    seconds = dict.fromkeys(MODELS, 0.0)
    torch.manual_seed(s.seed + 1)   # shuffling and flips

    def cycle():
        while True:
            yield from loader

    batches, k, stopped, t_train = cycle(), 0, False, time.monotonic()
    replans, window = [], (max(1, replan_at // 2), None)   # (step, time) the next re-plan measures from
    while k < trainers[MODELS[0]].steps:
        if time.monotonic() > train_deadline:
            stopped = True
            break
        images, targets = next(batches)
        batch = ([im.to(device, non_blocking=True) for im in images],
                 [{key: v.to(device, non_blocking=True) for key, v in tg.items()} for tg in targets])
        for name in MODELS:
            t1 = time.monotonic()
            trainers[name].step(batch)   # ends in a host sync (the loss value), so the time is the step's
            seconds[name] += time.monotonic() - t1
        k += 1
        if k == window[0]:
            window = (k, time.monotonic())
        if k == replan_at and window[1] is not None and k > window[0]:
            per_step = (time.monotonic() - window[1]) / (k - window[0])
            new = int(min(s.max_steps, k + (train_deadline - time.monotonic()) / per_step * REPLAN_FILL))
            for tr in trainers.values():
                tr.set_steps(new)
            replans.append({"at_step": k, "lockstep_s": per_step, "steps": trainers[MODELS[0]].steps})
            log(f"re-plan at step {k}: {per_step:.3f} s a lock-step -> {trainers[MODELS[0]].steps} steps each")
            window = (k, time.monotonic())
            later = int(0.6 * trainers[MODELS[0]].steps)
            replan_at = later if len(replans) < 2 and later > k else 0
        total = trainers[MODELS[0]].steps
        if k % max(1, total // 10) == 0 or k == total:
            log(f"step {k}/{total} ({time.monotonic() - t_train:.0f} s): " + ", ".join(
                f"{n} " + " ".join(f"{key} {v[-1]:.3f}" for key, v in trainers[n].curves.items()) for n in MODELS))
    steps = k
    result["schedule"] = {"steps": steps, "first_plan": planned, "fixed": bool(s.steps), "step_s": step_s,
                          "train_budget_s": train_budget, "replans": replans, "stopped_early": stopped,
                          "budget_too_small": steps < s.min_steps}

    # ---- evaluate each model
    metrics, train_stats = {}, {}
    for name in MODELS:
        stats = trainers[name].result(stopped)
        stats["seconds"] = seconds[name]
        curves = stats.pop("curves")
        history = stats.pop("history")
        stats["loss_first_last"] = [history[0], history[-1]] if history else []
        every = max(1, len(history) // CURVE_POINTS)   # window means: the curve, not every step's noise
        stats["loss_curves"] = {"every": every, **{
            key: [sum(v[i:i + every]) / len(v[i:i + every]) for i in range(0, len(v), every)]
            for key, v in curves.items()}}
        train_stats[name] = stats
        model = models[name]
        t = time.monotonic()
        m = detect.evaluate_model(model, val_ds, batch_size=16, device=device, progress=False)
        preds = m.pop("predictions")
        metrics[name] = m
        train_stats[name]["eval_s"] = time.monotonic() - t
        if name in detect.MASK_MODELS:
            detect.draw_predictions(val_ds, preds, out / f"{name}_masks.png", num_images=8,
                                    title=f"{name} ({s.backbone}, {stats['steps']} steps): val predictions >= 0.5")
        log(f"{name}: {stats['steps']} steps in {stats['seconds']:.0f} s, eval {train_stats[name]['eval_s']:.0f} s, "
            f"last-10% losses {json.dumps({key: round(v, 4) for key, v in stats['losses'].items()})}\n"
            + detect.format_metrics({name: m}))
    result["train"], result["metrics"] = train_stats, metrics

    # ---- inference images/s at the same input size (val images, trained weights, end to end)
    t = time.monotonic()
    images = [val_ds[i][0].to(device) for i in range(min(len(val_ds), 64))]
    speed = {}
    # Mask R-CNN with SPRNet's batched paste too: the like-for-like comparison (same weights)
    batched = detect.build_model("maskrcnn", train_ds.num_classes, backbone=s.backbone, image_size=s.image_size,
                                 fpn_channels=s.fpn_channels, paste="batched")
    batched.load_state_dict(models["maskrcnn"].state_dict())
    variants = [("sprnet", models["sprnet"]), ("maskrcnn", models["maskrcnn"]),
                ("maskrcnn_batched_paste", batched.to(device)), ("retinanet", models["retinanet"])]
    runs = [(bs, name, model) for bs in [int(b) for b in s.timing_batches.split(",")] for name, model in variants]
    for k, (bs, name, model) in enumerate(runs):
        share = (deadline - time.monotonic() - 3) / (len(runs) - k)   # an equal share of what is left
        if share < 1:
            speed.setdefault("skipped", []).append(f"{name}@{bs}")
            continue
        speed[f"{name}@{bs}"] = detect.throughput(model, images, batch_size=bs, warmup=5, iters=20, repeats=3,
                                                  max_seconds=share)
    result["speed"] = speed
    result["phases_s"]["timing"] = time.monotonic() - t
    result["phases_s"]["total"] = time.monotonic() - t_start

    # ---- goals, files, tables
    batch_sizes = [int(b) for b in s.timing_batches.split(",")]
    g = {}
    sm, mm, rm = metrics["sprnet"], metrics["maskrcnn"], metrics["retinanet"]
    pts = lambda m, kind, k: 100 * m[kind][k]   # noqa: E731
    # pycocotools gives -1 for a size the val split lacks: no difference there (None)
    diff = lambda a, b, kind, k: pts(a, kind, k) - pts(b, kind, k) if min(a[kind][k], b[kind][k]) >= 0 else None  # noqa: E731
    g["mask_ap_vs_maskrcnn_points"] = {k: diff(sm, mm, "segm", k) for k in AP_COLUMNS}
    gap = g["mask_ap_vs_maskrcnn_points"]
    g["mask_ap_ge_maskrcnn_minus_1"] = gap["AP"] >= -1.0
    g["mask_ap75_within_2"] = gap["AP75"] >= -2.0
    g["mask_aps_within_2"] = gap["APs"] >= -2.0 if gap["APs"] is not None else None
    g["box_ap_vs_retinanet_points"] = {k: diff(sm, rm, "bbox", k) for k in AP_COLUMNS}
    box = g["box_ap_vs_retinanet_points"]
    scales = [k for k in ("APs", "APm", "APl") if box[k] is not None]   # the scales the val split has
    g["box_ap_ge_retinanet_plus_1_every_scale"] = bool(scales) and all(box[k] >= 1.0 for k in scales)
    for bs in batch_sizes:
        for ref in ("maskrcnn", "maskrcnn_batched_paste"):
            a, r = speed.get(f"sprnet@{bs}"), speed.get(f"{ref}@{bs}")
            if a and r:
                g[f"speedup_vs_{ref}@{bs}"] = a["images_per_s"] / r["images_per_s"]
    ups = [v for k, v in g.items() if k.startswith("speedup_vs")]
    g["speedup_ge_1.3_at_every_batch"] = bool(ups) and min(ups) >= 1.3 and \
        len(ups) == 2 * len(batch_sizes)
    # AP goals decide nothing on a schedule shorter than --min-steps or when an anchor barely learned
    # (near-zero APs "meet" a small gap)
    g["anchors_learned"] = min(100 * mm["segm"]["AP"], 100 * rm["bbox"]["AP"]) >= MIN_ANCHOR_AP_POINTS
    g["conclusive"] = steps >= s.min_steps and g["anchors_learned"] and not stopped
    result["goals"] = g
    (out / "sprnet_device.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "sprnet_device.png")
    if tmp is not None:
        tmp.cleanup()

    lines = [f"SPRNet device run: {result.get('gpu', result['device'])}, torch {result['torch']}, {s.backbone}, input {s.image_size} px, "
             f"{steps} steps x batch {s.batch_size} for every model, {result['phases_s']['total']:.0f} s total"]
    cell = lambda v, fmt: f"{v:{fmt}}" if v is not None and v > -100 else f"{'-':>7}"   # noqa: E731
    lines.append(f"{'AP points':<22}" + "".join(f"{k:>7}" for k in AP_COLUMNS))
    for name in MODELS:
        for kind in ("segm", "bbox"):
            if kind in metrics[name]:
                lines.append(f"{name + (' mask' if kind == 'segm' else ' box'):<22}"
                             + "".join(cell(pts(metrics[name], kind, k), ">7.1f") for k in AP_COLUMNS))
    lines.append(f"{'mask vs maskrcnn':<22}" + "".join(cell(gap[k], ">+7.1f") for k in AP_COLUMNS))
    lines.append(f"{'box vs retinanet':<22}" + "".join(cell(box[k], ">+7.1f") for k in AP_COLUMNS))
    lines.append(f"{'inference img/s':<24}" + "".join(f"{'batch ' + str(b):>12}" for b in batch_sizes))
    for name, _ in variants:
        row = [speed.get(f"{name}@{b}") for b in batch_sizes]
        lines.append(f"{name:<24}" + "".join(f"{r['images_per_s']:>12.1f}" if r else f"{'-':>12}" for r in row))
    lines.append("goals: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in g.items()
                                       if not isinstance(v, dict)))
    for line in lines:
        log(line)
    print("\n" + "\n".join(lines))
    return 0


def plot(result: dict, path: Path) -> None:
    from hpdl.bench.common import pyplot

    plt = pyplot()

    names = list(result["metrics"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    w = 0.38
    for j, (kind, label) in enumerate((("bbox", "box AP"), ("segm", "mask AP"))):
        have = [i for i, n in enumerate(names) if kind in result["metrics"][n]]   # RetinaNet has no masks
        vals = [100 * result["metrics"][names[i]][kind]["AP"] for i in have]
        bars = ax1.bar([i + (j - 0.5) * w for i in have], vals, w, label=label)
        ax1.bar_label(bars, fmt="%.1f", fontsize=7)
    ax1.set_xticks(range(len(names)), names)
    ax1.set_ylabel("COCO AP (points)")
    ax1.set_title(f"AP on shapes val, {result['schedule']['steps']} steps each", fontsize=9)
    ax1.legend(fontsize=8)
    speed = {k: v for k, v in result["speed"].items() if k != "skipped"}
    keys = list(speed)
    bars = ax2.barh(range(len(keys)), [speed[k]["images_per_s"] for k in keys])
    ax2.bar_label(bars, fmt="%.0f", fontsize=7)
    ax2.set_yticks(range(len(keys)), keys, fontsize=7)
    ax2.set_xlabel("images/s (end to end, name@batch)")
    ax2.set_title(f"inference at {result['settings']['image_size']} px, {result.get('gpu', result['device'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
