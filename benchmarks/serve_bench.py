"""Flover serving benchmark: offline throughput, online Poisson sweep, reordering and tensor parallelism.

Device (2 x H200), one command; each phase writes JSON under --out as it goes:
    python3 benchmarks/serve_bench.py --phase device --out $OUT
      = prep, then `flover` on cuda:0 and `hf` on cuda:1 in parallel, then `tp` on both GPUs.
Report (here, after fetching the JSON): writes tables.md and PNG plots into docs/benchmarks/data/serve/ (copy the
JSON the results page cites to docs/benchmarks/data/serve/<date>/, then update docs/benchmarks/serve.md by hand)
    python3 benchmarks/serve_bench.py --phase report --out <dir with the JSON>
CPU smoke test of every phase with a tiny model:
    python3 benchmarks/serve_bench.py --phase device --smoke --out /tmp/serve-smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from hpdl.bench.common import run_metadata  # noqa: E402
from hpdl.serve.bench import release_engine  # noqa: E402

# ---- defaults: the setup ------------------------------------------------------------------
MODEL, DTYPE = "llama-1b", "bfloat16"  # TinyLlama-1.1B shape, random weights
N_OFFLINE, PROMPT_LEN, OUTPUT_LEN = 64, 128, (32, 512)
NUM_SLOTS, MAX_SEQ_LEN = 128, 640
STATIC_BS, SEQ_SUBSET, STATIC_SUBSET = 16, 4, 32  # baselines run on subsets (one request takes ~7 s)
RATES = [(2.0, 64), (8.0, 128), (32.0, 256), (128.0, 256), (math.inf, 256)]  # (req/s, requests)
SLO_TTFT_MS, SLO_TPOT_MS = 1000.0, 50.0
BIG_MODEL = "llama-7b"  # tensor-parallel batch-1 check on a larger model (None to skip)
SMOKE = dict(MODEL="llama-tiny", DTYPE="float32", N_OFFLINE=8, OUTPUT_LEN=(4, 24), PROMPT_LEN=16, NUM_SLOTS=8,
             MAX_SEQ_LEN=64, STATIC_BS=4, SEQ_SUBSET=2, STATIC_SUBSET=4,
             RATES=[(20.0, 8), (math.inf, 8)], BIG_MODEL="gpt2-tiny")


_T0 = time.perf_counter()


def _save(out: Path, name: str, data: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    print(f"[{time.perf_counter() - _T0:6.1f}s] {name}: saved {', '.join(data)}", flush=True)


def _versions(device: str | None = None) -> dict:
    """The harness's run metadata (UTC date, host, torch, transformers, commit, command; GPU name with a CUDA
    device) and how many GPUs this process sees."""
    import torch

    return run_metadata(device=device, versions=("transformers",), gpus=torch.cuda.device_count())


def _workload(n, rate=math.inf, seed=0):
    from hpdl.serve.bench import make_workload
    from hpdl.serve.worker import NAMED_CONFIGS

    return make_workload(n, (PROMPT_LEN, PROMPT_LEN), OUTPUT_LEN, rate, vocab_size=NAMED_CONFIGS[MODEL].vocab_size,
                         seed=seed)


def _engine(device, cuda_graph=True, reorder="prefix", tp=1, dtype=None, slots=None, all_reduce="nccl", model=None):
    from hpdl.serve import EngineConfig, LLMEngine, ModelSpec

    return LLMEngine(ModelSpec(config=model or MODEL, dtype=dtype or DTYPE),
                     EngineConfig(num_slots=slots or NUM_SLOTS, max_seq_len=MAX_SEQ_LEN, device=device,
                                  cuda_graph=cuda_graph, reorder=reorder, tensor_parallel_size=tp,
                                  tp_all_reduce=all_reduce))


def phase_flover(out: Path, device: str) -> None:
    """Correctness on GPU vs HF generate, offline throughput, reordering comparison, online sweep."""
    import torch

    from hpdl.serve.bench import run_engine, summarize

    res = {"versions": _versions(device), "device": device}
    res["correctness"] = _gpu_correctness(device)
    _save(out, "flover", res)
    wl = _workload(N_OFFLINE)
    eng = _engine(device)
    run_engine(eng, wl)  # warm-up: captures the CUDA graphs this workload needs
    eng.num_steps = {"prefill": 0, "decode": 0}
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    recs = run_engine(eng, wl)
    res["offline"] = summarize(recs, SLO_TTFT_MS, SLO_TPOT_MS) | {"stats": eng.stats(), "steps": dict(eng.num_steps)}
    res["cuda_graph"] = {"enabled": eng.executor.runner.cuda_graph, "error": eng.executor.runner.graph_error,
                         "graphs": len(eng.executor.runner._graphs)}
    cache = eng.executor.runner.cache
    res["memory"] = {"kv_bytes_per_slot": cache.bytes_per_slot, "num_slots": cache.num_slots,
                     "weights_bytes": sum(p.numel() * p.element_size() for p in eng.executor.runner.model.parameters()),
                     "peak_allocated_bytes": torch.cuda.max_memory_allocated() if device.startswith("cuda") else None}
    _save(out, "flover", res)
    res["online"] = {}
    for rate, n in RATES:
        wl_on = _workload(n, rate, seed=1)
        recs = run_engine(eng, wl_on)  # virtual clock: idle gaps skipped, busy time real
        res["online"][str(rate)] = summarize(recs, SLO_TTFT_MS, SLO_TPOT_MS)
        _save(out, "flover", res)
    release_engine(eng)
    del eng
    res["reorder"] = {}
    for mode in ("window", "prefix", "none"):  # eager decode, so the three layouts run the same kernels
        e = _engine(device, cuda_graph=False, reorder=mode)
        run_engine(e, wl[:8])
        e.scheduler.num_moves = e.scheduler.computed_rows = e.scheduler.live_rows = 0
        r = summarize(run_engine(e, wl))
        st = e.stats()
        res["reorder"][mode] = {"output_throughput": r["output_throughput"], "moves": st["reorder_moves"],
                                "decode_rows": st["decode_rows"], "live_rows": st["live_rows"]}
        _save(out, "flover", res)
        release_engine(e)
        del e


def _gpu_correctness(device: str) -> dict:
    """Flover (CUDA graphs, churn through 8 slots) vs HF generate per request, float32, a small Llama."""
    import tempfile

    import torch
    import transformers

    from hpdl.serve import EngineConfig, LLMEngine, ModelSpec, SamplingParams

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=2, intermediate_size=512, max_position_embeddings=512,
                                   bos_token_id=1, eos_token_id=2)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).to(device).eval()
    d = tempfile.mkdtemp()
    hf.save_pretrained(d)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(16)]
    maxt = [int(torch.randint(1, 120, (1,), generator=g)) for _ in prompts]
    eng = LLMEngine(ModelSpec(model=d), EngineConfig(num_slots=8, max_seq_len=256, device=device,
                                                     cuda_graph=device.startswith("cuda")))
    outs = eng.generate(prompts, [SamplingParams(max_tokens=m) for m in maxt])
    match = 0
    for p, m, o in zip(prompts, maxt, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device=device), attention_mask=torch.ones(1, len(p), dtype=torch.long,
                                                                                          device=device),
                              max_new_tokens=m, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        match += ref == o.token_ids
    return {"requests": len(prompts), "identical_to_hf_generate": match, "reorder_moves": eng.stats()["reorder_moves"]}


def phase_hf(out: Path, device: str) -> None:
    """HF baselines on the same workload: one at a time, static batches, generate_batch; step calibration."""
    import torch

    from hpdl.serve import baselines as B
    from hpdl.serve.bench import summarize
    from hpdl.serve.worker import NAMED_CONFIGS, ModelSpec

    torch.cuda.set_device(device) if device.startswith("cuda") else None
    hf = B.hf_model(ModelSpec(config=MODEL, dtype=DTYPE), NAMED_CONFIGS[MODEL], device)
    wl = _workload(N_OFFLINE)
    res = {"versions": _versions(device), "device": device, "attn": hf.config._attn_implementation}
    from hpdl.serve.bench import WorkloadRequest

    B.static_batches(hf, [WorkloadRequest(0.0, w.prompt, 8) for w in wl[:2]], 2)  # warm-up
    res["sequential"] = summarize(B.sequential(hf, wl[:SEQ_SUBSET])) | {"subset": SEQ_SUBSET}
    _save(out, "hf", res)
    res["static"] = summarize(B.static_batches(hf, wl[:STATIC_SUBSET], STATIC_BS)) | {"subset": STATIC_SUBSET}
    _save(out, "hf", res)
    res["calibration"] = {str(k): v for k, v in B.calibrate(hf, PROMPT_LEN, sorted({1, 2, 4, 8, STATIC_BS})).items()}
    _save(out, "hf", res)
    try:
        cb = B.continuous(hf, wl)
        if cb is not None:
            recs, tokens = cb
            res["cb"] = {"tokens": tokens, "seconds": recs[0].finish, "output_throughput": tokens / recs[0].finish,
                         "requests": len(wl)}
    except Exception as exc:  # noqa: BLE001 - a baseline failing must not lose the others
        res["cb"] = {"error": repr(exc)[:500]}
    _save(out, "hf", res)


def phase_tp(out: Path, device: str) -> None:
    """TP=2 vs TP=1: same greedy tokens (float32) and TPOT at batch 1 (bfloat16, CUDA graphs), with NCCL and
    with the symmetric-memory one-shot all-reduce."""
    from hpdl.serve import SamplingParams
    from hpdl.serve.bench import run_engine, summarize

    res = {"versions": _versions(device)}
    prompts = [w.prompt for w in _workload(8)]
    p = SamplingParams(max_tokens=64 if MODEL != "llama-tiny" else 8, ignore_eos=True, detokenize=False)
    one = _workload(1)
    one[0].output_len = min(256, OUTPUT_LEN[1])
    for tp in (1, 2):  # float32 token check
        e = _engine(device, tp=tp, dtype="float32", cuda_graph=False, reorder="window", slots=8)
        res[f"tokens_tp{tp}"] = [o.token_ids for o in e.generate(prompts, p)]
        res[f"all_reduce_fp32_tp{tp}"] = e.executor.runner.all_reduce
        release_engine(e)
        del e
    res["tp_tokens_identical"] = res["tokens_tp1"] == res["tokens_tp2"]
    _save(out, "tp", res)
    # symm last: its registry is per process, and this process re-creates its process group per engine
    for tp, ar, big in ((1, "nccl", False), (2, "nccl", False), (1, "nccl", True), (2, "nccl", True),
                        (2, "symm", False)):
        key = f"tp{tp}" + ("" if tp == 1 else f"_{ar}")
        if big:  # batch 1 only, on a model where weight reads dominate the step
            if BIG_MODEL is None:
                continue
            e = _engine(device, tp=tp, model=BIG_MODEL, slots=8)
            run_engine(e, one)
            res[f"batch1_{BIG_MODEL}_{key}"] = summarize(run_engine(e, one))
            release_engine(e)
            del e
            _save(out, "tp", res)
            continue
        e = _engine(device, tp=tp, all_reduce=ar)
        res[f"all_reduce_{key}"] = e.executor.runner.all_reduce
        res[f"tokens_bf16_{key}"] = e.generate([one[0].prompt], SamplingParams(
            max_tokens=one[0].output_len, ignore_eos=True, detokenize=False))[0].token_ids
        res[f"batch1_{key}"] = summarize(run_engine(e, one))
        run_engine(e, _workload(N_OFFLINE))  # warm-up (graph capture)
        res[f"offline_{key}"] = summarize(run_engine(e, _workload(N_OFFLINE)))
        release_engine(e)
        del e
        _save(out, "tp", res)
    t = {k: res.get(f"tokens_bf16_{k}") for k in ("tp1", "tp2_nccl", "tp2_symm")}
    res["bf16_tokens_tp2_nccl_eq_symm"] = t["tp2_nccl"] == t["tp2_symm"] if t["tp2_symm"] else None
    res["bf16_tokens_tp1_eq_tp2"] = t["tp1"] == t["tp2_nccl"] if t["tp2_nccl"] else None
    _save(out, "tp", res)


TP_CASES = {  # name: (model, tp, all_reduce, cuda_graph, limit_s); each runs in a fresh process, in this order
    "1b_tp2_graph_nccl": (None, 2, "nccl", True, 45),
    "7b_tp1_graph": ("BIG", 1, "nccl", True, 45),
    "7b_tp2_graph_nccl": ("BIG", 2, "nccl", True, 60),
    "1b_tp1_eager": (None, 1, "nccl", False, 30),
    "1b_tp2_eager_nccl": (None, 2, "nccl", False, 40),
    "7b_tp2_eager_nccl": ("BIG", 2, "nccl", False, 50),
    "1b_tp2_graph_symm": (None, 2, "symm", True, 45),
    "1b_tp1_graph": (None, 1, "nccl", True, 45),
    "1b_tp2_graph_hpdl": (None, 2, "hpdl", True, 45),
    "7b_tp2_graph_hpdl": ("BIG", 2, "hpdl", True, 60),
}


def phase_tpcase(out: Path, device: str, case: str) -> None:
    """One tensor-parallel configuration: batch-1 TPOT (and its greedy tokens), bfloat16."""
    import faulthandler

    from hpdl.serve import SamplingParams
    from hpdl.serve.bench import run_engine, summarize

    model, tp, ar, graph, limit = TP_CASES[case]
    faulthandler.dump_traceback_later(limit - 8, exit=False)  # a hang prints where it is stuck
    os.environ["HPDL_SERVE_FAULTHANDLER"] = str(limit - 10)
    one = _workload(1)
    one[0].output_len = min(256, OUTPUT_LEN[1])
    e = _engine(device, tp=tp, all_reduce=ar, cuda_graph=graph, reorder="prefix" if graph else "window",
                model=BIG_MODEL if model == "BIG" else None, slots=8)
    res = {"case": case, "all_reduce": e.executor.runner.all_reduce, "versions": _versions(device)}
    res["tokens"] = e.generate([one[0].prompt], SamplingParams(max_tokens=one[0].output_len, ignore_eos=True,
                                                               detokenize=False))[0].token_ids
    res["batch1"] = summarize(run_engine(e, one))
    res["graph_error"] = e.executor.runner.graph_error
    _save(out, f"tp_{case}", res)
    release_engine(e)


def phase_tp2(out: Path, smoke: bool) -> None:
    """Every TP_CASES entry in its own process with its own time limit (a hang costs only that case)."""
    me = [sys.executable, __file__, "--out", str(out)] + (["--smoke"] if smoke else [])
    graph_tp_hangs = False
    only = [c for c in os.environ.get("HPDL_TP_CASES", "").split(",") if c]  # a subset, in the given order
    for case in only or list(TP_CASES):
        _, tp, _, graph, limit = TP_CASES[case]
        if graph and tp > 1 and graph_tp_hangs:
            print(f"{case}: skipped (an earlier graph-mode TP case timed out)", flush=True)
            continue
        with open(out / f"tp_{case}.log", "w") as log:
            try:
                subprocess.run(me + ["--phase", "tpcase", "--case", case, "--device", "cpu" if smoke else "cuda"],
                               timeout=limit, stdout=log, stderr=subprocess.STDOUT, check=False,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
            except subprocess.TimeoutExpired:
                print(f"{case}: timed out after {limit} s", flush=True)
                graph_tp_hangs |= graph and tp > 1
        print(f"==== tp_{case}.log (tail)\n" + "\n".join((out / f"tp_{case}.log").read_text().splitlines()[-12:]),
              flush=True)


def phase_device(out: Path, smoke: bool) -> None:
    """flover on GPU 0 and hf on GPU 1 in parallel, then tp on both; each phase in its own process."""
    dev = "cpu" if smoke else "cuda"
    me = [sys.executable, __file__, "--out", str(out)] + (["--smoke"] if smoke else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    logs = {k: open(out / f"{k}.log", "w") for k in ("flover", "hf", "tp")}
    a = subprocess.Popen(me + ["--phase", "flover", "--device", f"{dev}:0" if not smoke else dev], env=env,
                         stdout=logs["flover"], stderr=subprocess.STDOUT)
    b = subprocess.Popen(me + ["--phase", "hf", "--device", f"{dev}:1" if not smoke else dev], env=env,
                         stdout=logs["hf"], stderr=subprocess.STDOUT)
    deadline = time.perf_counter() + 210  # both parallel phases share one deadline
    for proc in (a, b):
        try:
            proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
    try:
        subprocess.run(me + ["--phase", "tp", "--device", dev], env=env, timeout=180, check=False,
                       stdout=logs["tp"], stderr=subprocess.STDOUT)
    except subprocess.TimeoutExpired:
        print("tp phase timed out", flush=True)
    for k, f in logs.items():  # the tails land in the device tool's output
        f.close()
        print(f"==== {k}.log (tail)\n" + "\n".join((out / f"{k}.log").read_text().splitlines()[-15:]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", required=True, choices=["device", "flover", "hf", "tp", "tp2", "tpcase", "report"])
    ap.add_argument("--case", choices=sorted(TP_CASES), help="--phase tpcase: which configuration")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks every phase runs")
    ap.add_argument("--docs", default="docs/benchmarks/data/serve", help="report: where tables.md and the PNGs go")
    args = ap.parse_args()
    if args.smoke:
        globals().update(SMOKE)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.phase == "device":
        phase_device(out, args.smoke)
    elif args.phase == "tp2":
        phase_tp2(out, args.smoke)
    elif args.phase == "tpcase":
        phase_tpcase(out, args.device, args.case)
    elif args.phase == "report":
        sys.path.insert(0, str(Path(__file__).parent))
        from serve_report import report

        report(out, Path(args.docs), globals())
    else:
        {"flover": phase_flover, "hf": phase_hf, "tp": phase_tp}[args.phase](out, args.device)


if __name__ == "__main__":
    main()
