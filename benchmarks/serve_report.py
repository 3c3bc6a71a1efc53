"""Turn serve_bench.py's JSON into docs/benchmarks/serve.md and PNG plots (matplotlib, Agg).

Online baselines (one request at a time, static batches) are replayed through a FIFO queue with the step
times measured on the device in the same run (``hpdl.serve.baselines.simulate_static``), on the same arrival
trace as Flover's run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _load(d: Path, name: str) -> dict:
    p = d / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _f(x, nd=0):
    return "-" if x is None else f"{x:,.{nd}f}"


def report(src: Path, docs: Path, cfg: dict) -> None:
    from hpdl.serve.baselines import simulate_static
    from hpdl.serve.bench import summarize

    fl, hf, tp = _load(src, "flover"), _load(src, "hf"), _load(src, "tp")
    docs.mkdir(parents=True, exist_ok=True)
    v = fl.get("versions") or hf.get("versions") or {}
    L = ["# hpdl.serve benchmark: Flover temporal fusion vs Hugging Face baselines", "",
         f"Device: {v.get('gpus', '?')} x {v.get('gpu', '?')}; torch {v.get('torch')}, transformers "
         f"{v.get('transformers')}; date {v.get('date')}; one run. Model: `{cfg['MODEL']}` (LLaMA architecture, "
         f"random weights), {cfg['DTYPE']}; prompts {cfg['PROMPT_LEN']} tokens, outputs uniform in "
         f"{cfg['OUTPUT_LEN'][0]}..{cfg['OUTPUT_LEN'][1]}, greedy, EOS ignored. Flover: CUDA-graph decode, "
         f"{cfg['NUM_SLOTS']} slots of {cfg['MAX_SEQ_LEN']} positions.", "",
         "Command (device): `python3 benchmarks/serve_bench.py --phase device --out $OUT`; report: "
         "`python3 benchmarks/serve_bench.py --phase report --out <json dir>`.", ""]
    if fl.get("correctness"):
        c = fl["correctness"]
        L += [f"GPU correctness check (float32 small Llama, CUDA graphs, {c['requests']} requests through 8 slots, "
              f"{c['reorder_moves']} reorder moves): {c['identical_to_hf_generate']}/{c['requests']} requests "
              "token-identical to HF `generate` run alone.", ""]
    # ---- offline ----
    off = fl.get("offline", {})
    rows = [("Flover (hpdl.serve)", off.get("output_throughput"), f"{cfg['N_OFFLINE']} requests")]
    if "sequential" in hf:
        rows.append(("HF generate, one at a time", hf["sequential"]["output_throughput"],
                     f"first {hf['sequential']['subset']} requests"))
    if "static" in hf:
        rows.append((f"HF generate, static batches of {cfg['STATIC_BS']}", hf["static"]["output_throughput"],
                     f"first {hf['static']['subset']} requests; useful tokens only"))
    if "output_throughput" in hf.get("cb", {}):
        rows.append(("transformers continuous batching (generate_batch)", hf["cb"]["output_throughput"],
                     f"{hf['cb']['requests']} requests, every one to the longest output "
                     f"({hf['cb']['tokens'] // hf['cb']['requests']} tokens)"))
    L += ["## Offline: all requests at t = 0", "", "| system | output tokens/s | Flover speed-up | measured on |",
          "|---|---:|---:|---|"]
    base = off.get("output_throughput")
    for name, thr, note in rows:
        L.append(f"| {name} | {_f(thr)} | {_f(base / thr, 1) + 'x' if base and thr else '-'} | {note} |")
    if off:
        L += ["", f"Flover offline: TTFT p50 {_f(off['median_ttft_ms'])} ms, TPOT mean {_f(off['mean_tpot_ms'], 2)} ms, "
              f"makespan {_f(off['makespan_s'], 2)} s."]
    _bar(docs / "serve_offline.png", rows)
    L += ["", "![offline throughput](serve_offline.png)", ""]
    # ---- memory and reordering ----
    mem = fl.get("memory")
    if mem:
        per = mem["kv_bytes_per_slot"]
        L += ["## GPU memory per concurrent request, and reordering", "",
              f"KV cache per slot (one concurrent request of up to {cfg['MAX_SEQ_LEN']} positions): {per / 2**20:.1f} MiB "
              f"= 2 (K,V) x layers x KV heads x positions x head_dim x bytes. Weights: {mem['weights_bytes'] / 2**30:.2f} GiB. "
              f"Peak allocated during the offline run with {cfg['NUM_SLOTS']} slots: "
              f"{_f((mem['peak_allocated_bytes'] or 0) / 2**30, 2)} GiB.", ""]
    ro = fl.get("reorder")
    if ro:
        L += ["Reordering (eager decode, same offline workload): Flover's window compaction, compaction anchored at "
              "slot 0 (what CUDA graphs need), and no reordering (the decode covers the span of live slots, holes "
              "included, so memory read and compute per live request grow by the span/live ratio).", "",
              "| layout | output tokens/s | slot moves | decode rows computed / live | ", "|---|---:|---:|---:|"]
        for mode, r in ro.items():
            L.append(f"| {mode} | {_f(r['output_throughput'])} | {r['moves']} | "
                     f"{r['decode_rows'] / max(r['live_rows'], 1):.3f} |")
        L.append("")
    # ---- online ----
    on = fl.get("online", {})
    calib = {int(k): tuple(v) for k, v in hf.get("calibration", {}).items()}
    if on:
        import hpdl.serve.bench as hb

        L += ["## Online: Poisson arrivals", "",
              "Flover ran each trace on the device (idle gaps skipped on a virtual clock, busy time real). The "
              "one-at-a-time and static-batch servers are the same traces through a FIFO queue with step times "
              "measured on the device in this run (marked *sim*). SLOs for goodput: TTFT <= "
              f"{cfg['SLO_TTFT_MS']:.0f} ms, TPOT <= {cfg['SLO_TPOT_MS']:.0f} ms.", "",
              "| rate (req/s) | requests | system | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | E2E p50 / p99 (s) | "
              "output tok/s | goodput (req/s) | makespan (s) |", "|---|---:|---|---|---|---|---:|---:|---:|"]
        plot = {}
        for rate, n in cfg["RATES"]:
            key = str(rate)
            if key not in on:
                continue
            res = {"Flover": on[key]}
            if calib:
                wl = hb.make_workload(n, (cfg["PROMPT_LEN"],) * 2, cfg["OUTPUT_LEN"], rate, vocab_size=32000, seed=1)
                res["one at a time (sim)"] = summarize(simulate_static(wl, calib, 1), cfg["SLO_TTFT_MS"],
                                                       cfg["SLO_TPOT_MS"])
                res[f"static {cfg['STATIC_BS']} (sim)"] = summarize(simulate_static(wl, calib, cfg["STATIC_BS"]),
                                                                     cfg["SLO_TTFT_MS"], cfg["SLO_TPOT_MS"])
            for name, r in res.items():
                plot.setdefault(name, []).append((rate, r))
                L.append(f"| {rate:g} | {n} | {name} | {_f(r['median_ttft_ms'])} / {_f(r['p99_ttft_ms'])} | "
                         f"{_f(r.get('median_tpot_ms'), 1)} / {_f(r.get('p99_tpot_ms'), 1)} | "
                         f"{_f(r['median_e2el_ms'] / 1e3, 2)} / {_f(r['p99_e2el_ms'] / 1e3, 2)} | "
                         f"{_f(r['output_throughput'])} | {_f(r.get('goodput'), 2)} | {_f(r['makespan_s'], 1)} |")
        seq = plot.get("one at a time (sim)")
        if seq:
            L += ["", "Makespan (first arrival to last finish), Flover vs one request at a time on the same trace:", "",
                  "| rate (req/s) | requests | Flover (s) | one at a time (s) | ratio |", "|---|---:|---:|---:|---:|"]
            for (rate, f), (_, q) in zip(plot["Flover"], seq):
                L.append(f"| {rate:g} | {f['requests']} | {f['makespan_s']:.1f} | {q['makespan_s']:.1f} | "
                         f"{q['makespan_s'] / f['makespan_s']:.1f}x |")
        _online_plot(docs / "serve_online.png", plot)
        L += ["", "![online latency and throughput](serve_online.png)", ""]
        if calib:
            c1 = calib[1]
            cap = 1.0 / (c1[0] + ((cfg["OUTPUT_LEN"][0] + cfg["OUTPUT_LEN"][1]) / 2 - 1) * c1[1])
            L += [f"One-request-at-a-time capacity from the calibration: {cap:.3f} req/s. At every rate above it "
                  "the sequential server's makespan is its total service time; the table's makespan column gives "
                  "Flover's ratio against it at each rate.", ""]
    # ---- tensor parallel ----
    if tp:
        L += ["## Tensor parallelism (2 GPUs)", "",
              f"Greedy tokens, float32, 8 requests x 64 tokens: TP=2 ({tp.get('all_reduce_fp32_tp2')} all-reduce) "
              f"identical to TP=1: **{tp.get('tp_tokens_identical')}**.", "",
              f"| | all-reduce | TPOT at batch 1 (ms) | offline output tok/s ({cfg['N_OFFLINE']} requests) |",
              "|---|---|---:|---:|"]
        for key in ("tp1", "tp2_nccl", "tp2_symm"):
            b, o = tp.get(f"batch1_{key}", {}), tp.get(f"offline_{key}", {})
            if b:
                L.append(f"| {key} | {tp.get(f'all_reduce_{key}')} | {_f(b.get('mean_tpot_ms'), 3)} | "
                         f"{_f(o.get('output_throughput'))} |")
        big = cfg.get("BIG_MODEL")
        if big and tp.get(f"batch1_{big}_tp1"):
            t1, t2 = tp[f"batch1_{big}_tp1"]["mean_tpot_ms"], tp.get(f"batch1_{big}_tp2_nccl", {}).get("mean_tpot_ms")
            L += ["", f"`{big}` (random weights, bfloat16, CUDA graphs), TPOT at batch 1: TP=1 {_f(t1, 3)} ms, "
                  f"TP=2 (NCCL) {_f(t2, 3)} ms" + (f" ({t1 / t2:.2f}x)." if t2 else ".")]
        cases = {c: _load(src, f"tp_{c}") for c in ("1b_tp1_eager", "1b_tp2_eager_nccl", "1b_tp2_graph_nccl",
                                                  "7b_tp1_graph", "7b_tp2_graph_nccl", "1b_tp2_graph_symm")}
        cases = {c: d for c, d in cases.items() if d}
        if cases:
            L += ["", "Second device run, one fresh process per configuration (bfloat16, 8 slots, one request of "
                  f"{cfg['PROMPT_LEN']} + 256 tokens):", "", "| configuration | all-reduce | TPOT at batch 1 (ms) |",
                  "|---|---|---:|"]
            if "batch1_tp1" in tp:
                L.append(f"| 1b_tp1_graph (first run) | none | {tp['batch1_tp1']['mean_tpot_ms']:.3f} |")
            for c, d in cases.items():
                L.append(f"| {c} | {d['all_reduce']} | {d['batch1']['mean_tpot_ms']:.3f} |")
        if tp.get("bf16_tokens_tp1_eq_tp2") is not None:
            L += ["", f"bfloat16 batch-1 tokens ({cfg['OUTPUT_LEN'][1] if cfg['OUTPUT_LEN'][1] < 256 else 256} greedy): "
              f"TP=2 NCCL == TP=2 symm: {tp.get('bf16_tokens_tp2_nccl_eq_symm')}; TP=1 == TP=2: "
              f"{tp.get('bf16_tokens_tp1_eq_tp2')} (bfloat16 sums in a different order may flip near-ties)."]
        L.append("")
    (docs / "serve.md").write_text("\n".join(L) + "\n")


def _bar(path: Path, rows) -> None:
    rows = [r for r in rows if r[1]]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r[0] for r in rows][::-1], [r[1] for r in rows][::-1], color="tab:blue")
    ax.set_xscale("log")
    ax.set_xlabel("output tokens/s (log)")
    ax.set_title("Offline throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _online_plot(path: Path, plot: dict) -> None:
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    for name, pts in plot.items():
        xs = [r if math.isfinite(r) else 2 * max(p[0] for p in pts if math.isfinite(p[0])) for r, _ in pts]
        axes[0].plot(xs, [p["median_ttft_ms"] for _, p in pts], "o-", label=name)
        axes[1].plot(xs, [p.get("median_tpot_ms", float("nan")) for _, p in pts], "o-", label=name)
        axes[2].plot(xs, [p["p99_e2el_ms"] / 1e3 for _, p in pts], "o-", label=name)
        axes[3].plot(xs, [p["output_throughput"] for _, p in pts], "o-", label=name)
    for ax, t in zip(axes, ["TTFT p50 (ms)", "TPOT p50 (ms)", "E2E p99 (s)", "output tokens/s"]):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s; rightmost = all at t=0)")
        ax.set_title(t)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
