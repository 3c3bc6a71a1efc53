"""Serving benchmark: workloads, per-request records, metrics, and the Flover / HTTP runners.

Metrics follow vLLM's ``benchmarks/benchmark_serving.py``: TTFT (arrival to first token), TPOT
(``(E2EL - TTFT) / (output_len - 1)``), ITL (gaps between consecutive tokens), E2EL (arrival to last token),
request and output-token throughput over the makespan (first arrival to last finish), and goodput (requests per
second that meet every SLO). Arrivals are Poisson at ``request_rate`` or gamma with ``burstiness`` (< 1 is
burstier), as in vLLM.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class WorkloadRequest:
    arrival: float  # seconds after the start
    prompt: list[int]
    output_len: int


@dataclass
class RequestRecord:
    """What a run observed for one request (absolute times in seconds on the run's clock)."""

    arrival: float
    prompt_len: int
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None  # when the response was complete (static batching: the batch's end)

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return (self.finish if self.finish is not None else self.token_times[-1]) - self.arrival

    @property
    def tpot(self) -> float | None:
        n = self.output_len
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None


def make_workload(num_requests: int, prompt_len: tuple[int, int] = (128, 128), output_len: tuple[int, int] = (32, 512),
                  request_rate: float = math.inf, burstiness: float = 1.0, vocab_size: int = 32000,
                  corpus_ids: list[int] | None = None, seed: int = 0) -> list[WorkloadRequest]:
    """``num_requests`` requests with uniform prompt/output lengths in the inclusive ranges given.

    Prompts are random token ids in ``[3, vocab_size)`` or, with ``corpus_ids`` (a tokenized local text), slices
    of it at random offsets. ``request_rate = inf`` puts every arrival at 0 (offline). Raises ValueError for
    non-positive counts, empty ranges, or a corpus shorter than the longest prompt.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be > 0, got {request_rate}, {burstiness}")
    rng = np.random.default_rng(seed)
    if math.isinf(request_rate):
        arrivals = np.zeros(num_requests)
    else:  # gamma inter-arrival times with mean 1/rate; shape 1 = Poisson process
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
        arrivals = np.cumsum(gaps) - gaps[0]
    plens = rng.integers(prompt_len[0], prompt_len[1] + 1, size=num_requests)
    olens = rng.integers(output_len[0], output_len[1] + 1, size=num_requests)
    if corpus_ids is not None and len(corpus_ids) <= prompt_len[1]:
        raise ValueError(f"corpus has {len(corpus_ids)} tokens, fewer than the longest prompt {prompt_len[1]}")
    out = []
    for a, p, o in zip(arrivals, plens, olens):
        if corpus_ids is not None:
            s = int(rng.integers(0, len(corpus_ids) - p))
            prompt = list(corpus_ids[s:s + p])
        else:
            prompt = rng.integers(3, vocab_size, size=p).tolist()
        out.append(WorkloadRequest(float(a), prompt, int(o)))
    return out


def summarize(records: list[RequestRecord], slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              ) -> dict:
    """Metrics of one run: latency stats in ms (mean, median, p99), throughput, goodput, makespan in s."""
    done = [r for r in records if r.token_times]
    if not done:
        raise ValueError("no request produced a token")
    start = min(r.arrival for r in records)
    makespan = max(r.arrival + r.e2e for r in done) - start
    out = {"requests": len(done), "makespan_s": makespan, "request_throughput": len(done) / makespan,
           "output_throughput": sum(r.output_len for r in done) / makespan}

    def stats(name, xs):
        xs = np.asarray([x for x in xs if x is not None], dtype=float) * 1e3
        if xs.size:
            out[f"mean_{name}_ms"] = float(xs.mean())
            out[f"median_{name}_ms"] = float(np.median(xs))
            out[f"p99_{name}_ms"] = float(np.percentile(xs, 99))

    stats("ttft", [r.ttft for r in done])
    stats("tpot", [r.tpot for r in done])
    stats("itl", [g for r in done for g in np.diff(r.token_times)])
    stats("e2el", [r.e2e for r in done])
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(1 for r in done if (slo_ttft_ms is None or r.ttft * 1e3 <= slo_ttft_ms)
                   and (slo_tpot_ms is None or r.tpot is None or r.tpot * 1e3 <= slo_tpot_ms))
        out["goodput"] = good / makespan
    return out


def run_engine(engine, workload: list[WorkloadRequest], virtual_clock: bool = True, progress=None
               ) -> list[RequestRecord]:
    """Serve ``workload`` with an in-process ``LLMEngine`` (greedy, EOS ignored, each to its output_len).

    ``virtual_clock``: time advances by each step's measured duration and jumps over idle gaps to the next
    arrival, so a light-load run costs only its busy time. Every step syncs the device (it samples on the
    host), so step durations are real. Without it, arrivals are waited for on the wall clock.
    """
    from hpdl.serve.sampling import SamplingParams

    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    records = [RequestRecord(w.arrival, len(w.prompt)) for w in workload]
    by_id: dict[str, int] = {}
    nxt, now, t0 = 0, 0.0, time.perf_counter()
    while nxt < len(order) or engine.has_unfinished():
        if not virtual_clock:
            now = time.perf_counter() - t0
        if not engine.has_unfinished() and nxt < len(order):
            gap = workload[order[nxt]].arrival - now
            if gap > 0:
                if not virtual_clock:
                    time.sleep(gap)
                now = workload[order[nxt]].arrival if virtual_clock else time.perf_counter() - t0
        while nxt < len(order) and workload[order[nxt]].arrival <= now:
            w = workload[order[nxt]]
            rid = engine.add_request(w.prompt, SamplingParams(max_tokens=w.output_len, ignore_eos=True,
                                                              detokenize=False))
            by_id[rid] = order[nxt]
            nxt += 1
        s = time.perf_counter()
        outs = engine.step()
        now = now + (time.perf_counter() - s) if virtual_clock else time.perf_counter() - t0
        for o in outs:
            rec = records[by_id[o.request_id]]
            rec.token_times.extend([now] * len(o.new_token_ids))
            if o.finished:
                rec.finish = now
                if progress is not None:
                    progress()
    return records


async def _http_one(client, url: str, model: str, w: WorkloadRequest, rec: RequestRecord, t0: float) -> None:
    body = {"model": model, "prompt": w.prompt, "max_tokens": w.output_len, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"server answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                rec.token_times.append(time.perf_counter() - t0)
    rec.finish = time.perf_counter() - t0


async def run_http(url: str, model: str, workload: list[WorkloadRequest], max_concurrency: int | None = None,
                   timeout_s: float = 600.0) -> list[RequestRecord]:
    """Replay ``workload`` against an OpenAI-compatible server in real time (streamed completions).

    One SSE chunk is counted as one token (the server sends one chunk per token with text, so held-back
    or empty deltas make ITL coarser; TTFT and E2EL are exact).
    """
    import httpx

    records = [RequestRecord(w.arrival, len(w.prompt)) for w in workload]
    sem = asyncio.Semaphore(max_concurrency or len(workload))
    t0 = time.perf_counter()

    async def one(w, rec):
        await asyncio.sleep(max(0.0, w.arrival - (time.perf_counter() - t0)))
        async with sem:
            await _http_one(client, url, model, w, rec, t0)

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        await asyncio.gather(*(one(w, r) for w, r in zip(workload, records)))
    return records


def release_engine(engine) -> None:
    """Tear ``engine`` (an :class:`hpdl.serve.LLMEngine`) down between the engines of one benchmark process:
    ``shutdown()`` (tensor-parallel workers stopped, their process group destroyed), the in-process runner's CUDA
    graphs dropped and the device synchronised (``ModelRunner.close``; repeating it after a tensor-parallel
    shutdown is harmless), then a garbage collection and, on CUDA, the caching allocator's free blocks returned
    (``torch.cuda.empty_cache``) so that the next engine's memory and graph capture start from a clean pool.

    The engine must not be used afterwards; its weights are freed once the caller drops its last reference
    (``del engine``, or rebinding the name to the next engine).
    """
    import gc

    import torch

    engine.shutdown()
    runner = getattr(engine.executor, "runner", None)
    if runner is not None:
        runner.close()
    del engine, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- roofline: how far a decode step is from the memory-bandwidth limit ----------------------------------
def hbm_bandwidth(device, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Measured copy bandwidth of ``device`` in bytes/s (read + write of an ``nbytes`` buffer, best of ``iters``):
    the attainable HBM bandwidth a decode step is compared against (H200 spec 4.8 TB/s)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        nbytes = min(nbytes, 1 << 26)
    x = torch.empty(nbytes // 2, dtype=torch.float16, device=dev)
    y = torch.empty_like(x)
    best = math.inf
    for _ in range(iters + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        y.copy_(x)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t)
    return 2 * x.numel() * x.element_size() / best


def decode_roofline(engine, n: int, ctx_len: int, iters: int = 20, hbm: float | None = None) -> dict | None:
    """Time one decode step of ``n`` rows at ``ctx_len`` cached positions through the engine's model runner (host
    inputs, the forward or graph replay, one device sync: the engine's step minus scheduling and sampling) and
    compare the bytes it must move at least (``hpdl.serve.fused.step_bytes``: weights once, each row's K/V)
    with the device's bandwidth.

    Returns ``{"rows", "ctx_len", "step_ms", "min_bytes", "bytes_per_s", "hbm_bytes_per_s", "fraction",
    "path"}``, or None for a tensor-parallel engine. Call it on an idle engine: it writes K/V into slots
    ``[0, n)``. Raises ValueError if requests are in flight.
    """
    import torch

    from hpdl.serve.fused import step_bytes
    from hpdl.serve.scheduler import StepPlan

    runner = getattr(engine.executor, "runner", None)
    if engine.config.tensor_parallel_size != 1 or runner is None:
        return None
    if engine.has_unfinished():
        raise ValueError("decode_roofline needs an idle engine (it writes into free KV slots)")
    n = max(1, min(n, runner.cache.num_slots))
    ctx_len = max(0, min(ctx_len, runner.cache.max_seq_len - 1))
    plan = StepPlan(start=0, n=n, decode_tokens=[1] * n, decode_positions=[ctx_len] * n)
    cuda = runner.device.type == "cuda"
    times = []
    for i in range(iters + 2):
        t = time.perf_counter()
        out = runner.execute(plan)
        if cuda:
            torch.cuda.synchronize(runner.device)
        if i >= 2:  # the first two capture graphs / compile kernels
            times.append(time.perf_counter() - t)
        del out
    step = float(np.median(times))
    need = step_bytes(runner.model, runner.cache, n, ctx_len)
    hbm = hbm if hbm is not None else hbm_bandwidth(runner.device)
    return {"rows": n, "ctx_len": ctx_len, "step_ms": step * 1e3, "min_bytes": need, "bytes_per_s": need / step,
            "hbm_bytes_per_s": hbm, "fraction": need / step / hbm,
            "path": ("fused" if runner.fused else "eager") + (" + CUDA graph" if runner.cuda_graph else "")}


def roofline_line(r: dict) -> str:
    """One line for ``hpdl bench serve``: achieved bytes/s of a decode step against the measured bandwidth."""
    return (f"roofline: decode step of {r['rows']} rows at {r['ctx_len']} cached positions ({r['path']}): "
            f"{r['step_ms']:.3f} ms, >= {r['min_bytes'] / 1e6:.4g} MB moved -> {r['bytes_per_s'] / 1e9:.4g} GB/s = "
            f"{100 * r['fraction']:.1f}% of the measured copy bandwidth {r['hbm_bytes_per_s'] / 1e9:.4g} GB/s")
