"""Baselines for the serving benchmark, all on Hugging Face ``transformers``.

- ``sequential``: ``generate`` one request at a time (how FasterTransformer-era servers ran one instance).
- ``static_batches``: FasterTransformer-style static batching: fixed batches in arrival order, left-padded, each
  run to its longest request; responses return when the batch ends (useful tokens = each request's own).
- ``continuous``: transformers' own continuous batching (``generate_batch``), where the installed version has it.

Online (arrivals over time) one-request-at-a-time and static batching are deterministic queues whose service
times depend only on batch size and lengths, so ``simulate_*`` replays the arrival trace through a FIFO queue
using step times measured by ``calibrate`` in the same run; results say so.
"""

from __future__ import annotations

import time

import torch

from hpdl.serve.bench import RequestRecord, WorkloadRequest


def hf_model(spec, cfg, device):
    """The Hugging Face ``transformers`` model the baselines run: ``spec.model``'s checkpoint (``from_pretrained``)
    or, for a named random-weight config, the same architecture (``cfg.to_hf()``) with HF's own random init seeded
    by ``spec.seed`` (throughput does not depend on the weights' values).

    Args:
        spec: the engine's :class:`hpdl.serve.worker.ModelSpec` (``model`` dir or named ``config``, ``dtype``,
            ``seed``).
        cfg: the engine's model config (``engine.model_config``, or ``NAMED_CONFIGS[name]``).
        device: where the model lives (``"cpu"``, ``"cuda:0"``).

    Returns:
        an ``AutoModelForCausalLM`` in eval mode, weights in ``spec.dtype``, on ``device``.
    """
    import transformers

    from hpdl.serve.worker import DTYPES

    dtype = DTYPES[spec.dtype]
    if spec.model is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(spec.model, dtype=dtype).to(device).eval()
    torch.manual_seed(spec.seed)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(cfg.to_hf(), dtype=dtype).eval()


def _clock_processor():
    from transformers import LogitsProcessor

    class Clock(LogitsProcessor):
        """Records the host time of every decoding step (generate syncs each step on its stopping check)."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    return Clock()


@torch.inference_mode()
def _generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
    """Left-padded greedy generate of exactly ``new_tokens`` per row (EOS suppressed); (start, step times)."""
    from transformers import LogitsProcessorList

    dev = model.device
    T = max(map(len, prompts))
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = torch.tensor(p), 1
    clock = _clock_processor()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    return start, clock.times


def sequential(model, workload: list[WorkloadRequest]) -> list[RequestRecord]:
    """Offline, one request at a time in list order; arrival = 0 for all (all present at t = 0)."""
    recs, t0 = [], time.perf_counter()
    for w in workload:
        _, times = _generate(model, [w.prompt], w.output_len)
        recs.append(RequestRecord(0.0, len(w.prompt), [t - t0 for t in times]))
    return recs


def static_batches(model, workload: list[WorkloadRequest], batch_size: int) -> list[RequestRecord]:
    """Offline static batching: consecutive batches of ``batch_size``, each run to its longest output."""
    recs, t0 = [], time.perf_counter()
    for i in range(0, len(workload), batch_size):
        batch = workload[i:i + batch_size]
        _, times = _generate(model, [w.prompt for w in batch], max(w.output_len for w in batch))
        end = times[-1] - t0
        recs += [RequestRecord(0.0, len(w.prompt), [t - t0 for t in times[:w.output_len]], finish=end) for w in batch]
    return recs


def continuous(model, workload: list[WorkloadRequest]) -> tuple[list[RequestRecord], int] | None:
    """transformers' ``generate_batch`` on every prompt with one ``max_new_tokens`` (its API has no per-request
    length), the longest output of the workload. Returns (records, tokens generated) or None if unavailable.
    Per-token times are not exposed, so each record carries only its finish time (throughput only).
    """
    from transformers import GenerationConfig

    if not hasattr(model, "generate_batch"):
        return None
    m = max(w.output_len for w in workload)
    gc = GenerationConfig(max_new_tokens=m, do_sample=False, eos_token_id=None, pad_token_id=0)  # no EOS
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=[w.prompt for w in workload], generation_config=gc)
    end = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return [RequestRecord(0.0, len(w.prompt), [end], finish=end) for w in workload], tokens


def calibrate(model, prompt_len: int, batch_sizes: list[int], steps: int = 32) -> dict[int, tuple[float, float]]:
    """Measured (time to first token, seconds per later step) of ``generate`` at each batch size."""
    out = {}
    for b in batch_sizes:
        prompts = [[5] * prompt_len] * b
        _generate(model, prompts, 4)  # warm-up
        start, times = _generate(model, prompts, steps)
        out[b] = (times[0] - start, (times[-1] - times[0]) / (len(times) - 1))
    return out


def _interp(calib: dict[int, tuple[float, float]], b: int) -> tuple[float, float]:
    ks = sorted(calib)
    if b in calib:
        return calib[b]
    hi = next((k for k in ks if k >= b), ks[-1])
    lo = max((k for k in ks if k <= b), default=ks[0])
    if hi == lo:
        return calib[hi]
    f = (b - lo) / (hi - lo)
    return tuple(calib[lo][i] + f * (calib[hi][i] - calib[lo][i]) for i in range(2))


def simulate_static(workload: list[WorkloadRequest], calib: dict[int, tuple[float, float]], batch_size: int
                    ) -> list[RequestRecord]:
    """FIFO server: when idle, take up to ``batch_size`` arrived requests and run them to their longest output
    (``batch_size = 1`` is one-request-at-a-time). Service times come from ``calibrate``."""
    pending = sorted(workload, key=lambda w: w.arrival)
    recs, now, i = {}, 0.0, 0
    while i < len(pending):
        now = max(now, pending[i].arrival)
        batch = [w for w in pending[i:i + batch_size] if w.arrival <= now]
        i += len(batch)
        first, step = _interp(calib, len(batch))
        longest = max(w.output_len for w in batch)
        end = now + first + (longest - 1) * step
        for w in batch:
            times = [now + first + k * step for k in range(w.output_len)]
            recs[id(w)] = RequestRecord(w.arrival, len(w.prompt), times, finish=end)
        now = end
    return [recs[id(w)] for w in workload]


def compare(engine, hf_model, workload: list[WorkloadRequest], systems: list[str], static_batch_size: int = 16,
            slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None, progress=None) -> dict[str, dict]:
    """Run ``workload`` on each system and summarise: ``flover`` (the engine), ``sequential``, ``static``, ``cb``.

    Offline workloads (all arrivals 0) run every baseline for real; online ones replay ``sequential`` and
    ``static`` through ``simulate_static`` with step times calibrated on ``hf_model`` now, and skip ``cb``.
    Raises ValueError for an unknown system name.
    """
    from hpdl.serve.bench import run_engine, summarize

    known = ("flover", "sequential", "static", "cb")
    bad = [s for s in systems if s not in known]
    if bad:
        raise ValueError(f"systems must be among {known}, got {bad}")
    offline = all(w.arrival == 0 for w in workload)
    out: dict[str, dict] = {}
    calib = None
    if not offline and hf_model is not None and {"sequential", "static"} & set(systems):
        plen = max(len(w.prompt) for w in workload)
        calib = calibrate(hf_model, plen, sorted({1, 2, 4, 8, static_batch_size}))
    for s in systems:
        if s == "flover":
            recs = run_engine(engine, workload, progress=progress)
        elif s == "cb":
            if not offline:
                continue
            res = continuous(hf_model, workload)
            if res is None:
                continue
            recs, tokens = res
            out[s] = summarize(recs) | {"output_throughput": tokens / recs[0].finish, "note": "all to max output"}
            continue
        elif offline:
            recs = sequential(hf_model, workload) if s == "sequential" else \
                static_batches(hf_model, workload, static_batch_size)
        else:
            recs = simulate_static(workload, calib, 1 if s == "sequential" else static_batch_size)
        out[s] = summarize(recs, slo_ttft_ms, slo_tpot_ms)
        if not offline and s != "flover":
            out[s]["note"] = "simulated from calibrated step times"
    return out
