"""The Flover engine: one loop of schedule -> execute -> sample -> update (vLLM v1's ``EngineCore.step``).

Each ``step()`` first prefills newly admitted requests as one batch (Flover's pre-processing stage; packed
without padding by default, ``EngineConfig.prefill``), then runs ONE fused decode forward over every running
request (temporal fusion; with ``prefill="chunked"`` one mixed plan of both). Requests join between
steps and leave the moment they finish; their slots are reclaimed by buffer reordering before the next
forward. Not thread-safe: ``AsyncEngine`` drives it from a single thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field

import torch

from hpdl.runtime.errors import WorkerFailedError
from hpdl.serve.executor import RunnerArgs, TPExecutor, UniprocExecutor
from hpdl.serve.sampling import InvalidParamError, Sampler, SamplingParams, TokenLogprob, prompt_logprobs
from hpdl.serve.scheduler import Request, Scheduler, StepPlan
from hpdl.serve.tokenizer import IncrementalDetokenizer, load_tokenizer
from hpdl.serve.worker import ModelSpec

log = logging.getLogger("hpdl.serve")


@dataclass
class EngineConfig:
    """Engine knobs (vLLM names in brackets).

    num_slots: pre-allocated KV slots, the most requests decoded together [max_num_seqs].
    max_seq_len: positions per slot, prompt + output [max_model_len].
    max_prefill_tokens: the prefill token budget [max_num_batched_tokens]: padded tokens per batched prefill
        (``prefill="padded"``), prompt tokens per packed prefill ("packed"), or decode rows plus prompt-chunk
        tokens per step ("chunked"; must exceed num_slots).
    prefill: "padded" (prompts right-padded to the longest, the eager model's batch), "packed" (the default: no
        padding, ``hpdl.serve.prefill``: one varlen attention launch per layer) or "chunked" (packed, and split into
        chunks mixed into every decode step under the budget, so running requests keep decoding while a long
        prompt is prefilled; ``Scheduler.schedule_mixed``).
    reorder: "window" (Flover), "prefix" (anchored at slot 0; forced with CUDA graphs) or "none".
    tp_all_reduce: "nccl", "symm" (torch's one-shot symmetric-memory all-reduce for decode on CUDA) or "hpdl"
        (hpdl.comm's peer-memory all-reduce on CUDA, every size); NCCL where the fast one is unavailable.
    fused_decode: decode with the fused Triton kernels (``hpdl.serve.fused``); None = on CUDA for LLaMA models
        on one device, the eager step elsewhere (the CPU reference). True where unsupported is a ValueError.
    fused_gemm: the fused step's GEMMs: "cublas" or "stream" (``hpdl.serve.stream_gemm``, weight-streaming
        Triton GEMMs with the residual adds, SiLU-mul and RMSNorms fused in; ``hpdl.serve.fused.fused_decode``).
        "stream" where the fused step does not run (fused_decode False, or None resolving to eager) is a
        ValueError rather than silently eager. "auto": per decode batch bucket, whichever of the stream GEMMs
        (with PDL) and cuBLAS the device measures faster at the bucket's first CUDA-graph capture
        (``ModelRunner``'s ``gemm_choice``); ignored where the fused step does not run.
    ranks_per_gpu: tensor-parallel ranks that share one GPU (None: ``HPDL_RANKS_PER_GPU``, 1), e.g. TP = 4 on
        one GPU with 4: the code path of a 4-GPU node (gloo instead of NCCL), for correctness, not speed.
    """

    num_slots: int = 64
    max_seq_len: int = 1024
    max_prefill_tokens: int = 8192
    reorder: str = "window"
    tensor_parallel_size: int = 1
    device: str = "cpu"
    cuda_graph: bool = False
    tp_all_reduce: str = "nccl"
    fused_decode: bool | None = None
    ranks_per_gpu: int | None = None
    fused_gemm: str = "cublas"
    prefill: str = "packed"

    def __post_init__(self):
        from hpdl.serve.scheduler import REORDER_MODES, check_prefill

        if isinstance(self.num_slots, bool) or not isinstance(self.num_slots, int) or self.num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {self.num_slots!r}")
        # checked here, before any tensor-parallel rank starts or a cache is allocated (a 0 or float length
        # otherwise built an engine that refused every request, or failed inside torch.zeros)
        if isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be an int >= 2, got {self.max_seq_len!r} (each request needs a "
                             f"prompt token and an output token)")
        if self.reorder not in REORDER_MODES:
            raise ValueError(f"reorder must be one of {REORDER_MODES}, got {self.reorder!r}")
        check_prefill(self.prefill, self.max_prefill_tokens, self.num_slots)
        if self.fused_gemm not in ("cublas", "stream", "auto"):
            raise ValueError(f"fused_gemm must be 'cublas', 'stream' or 'auto', got {self.fused_gemm!r}")
        if self.fused_gemm == "stream" and self.fused_decode is False:
            raise ValueError("fused_gemm='stream' selects the fused decode step's GEMMs, but fused_decode=False "
                             "runs the eager step; use fused_gemm='cublas' or fused_decode=None/True")
        if self.tp_all_reduce not in ("nccl", "symm", "hpdl"):
            raise ValueError(f"tp_all_reduce must be 'nccl', 'symm' or 'hpdl', got {self.tp_all_reduce!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        if self.cuda_graph:
            self.reorder = "prefix"
        if self.tensor_parallel_size > 1 or self.ranks_per_gpu is not None:
            # checked here (also HPDL_RANKS_PER_GPU on CUDA), before any TP rank starts, not inside each rank
            from hpdl.runtime.launch import job_ranks_per_gpu

            job_ranks_per_gpu("cuda" if str(self.device).startswith("cuda") else "cpu", self.ranks_per_gpu)
        if str(self.device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available here (torch {torch.__version__}, "
                             f"{torch.cuda.device_count()} devices); use device='cpu'")


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request.

    ``new_token_ids``: tokens of this step; ``token_ids``: all output tokens, filled on the final output only (a
    copy per step would cost O(length) per token). ``delta``: text not sent before; ``text``: all sent so far.
    ``logprobs``: a ``TokenLogprob`` per new token when the request asked for them; ``prompt_logprobs``: on the
    request's first output, when asked. ``finish_reason`` "error": this request failed alone, ``error`` says
    why. Times are ``time.perf_counter()`` seconds.
    """

    request_id: str
    prompt_tokens: int
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    delta: str
    finished: bool
    finish_reason: str | None
    arrival: float
    first_token_time: float | None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float | None = None
    error: str | None = None


_FATAL = (WorkerFailedError, *((torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()))  # torch >= 2.8


def is_engine_fault(exc: BaseException) -> bool:
    """Errors after which the device or the executor cannot be trusted (the engine stops serving): a lost
    tensor-parallel rank and device errors (CUDA errors are sticky: every later kernel fails too). Anything
    else raised by a forward is retried request by request, so it fails only the request that causes it."""
    if isinstance(exc, _FATAL):
        return True
    msg = str(exc)
    return isinstance(exc, RuntimeError) and any(m in msg for m in ("CUDA error", "CUBLAS_STATUS", "cuDNN error",
                                                                       "NCCL error", "device-side assert"))


class LLMEngine:
    """Serve many generation requests with one fused decode step per iteration.

    Failure isolation: every request is validated (``make_request``) before it is queued; an exception raised
    for one request inside ``step`` (its sampling, logprobs, detokenization, or its part of a forward) finishes
    that request alone with ``finish_reason='error'``; only an engine fault (``is_engine_fault``) or a broken
    invariant propagates out of ``step``.

    Example:
        >>> eng = LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=4, max_seq_len=64))
        >>> [o.token_ids for o in eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3))][0].__len__()
        3
    """

    def __init__(self, spec: ModelSpec, config: EngineConfig | None = None, tokenizer=None):
        self.config = config = config or EngineConfig()
        args = RunnerArgs(config.num_slots, config.max_seq_len, config.device, config.cuda_graph, config.tp_all_reduce,
                          config.fused_decode, config.ranks_per_gpu, config.fused_gemm)
        self.executor = UniprocExecutor(spec, args) if config.tensor_parallel_size == 1 else \
            TPExecutor(spec, args, config.tensor_parallel_size)
        self.model_config = self.executor.config
        try:
            self.tokenizer = tokenizer or load_tokenizer(spec.model)
        except BaseException:  # the executor's ranks and process group would outlive this failed engine
            self.executor.shutdown()
            raise
        eos = self.model_config.eos_token_id
        self.eos_token_id = eos if eos is not None else getattr(self.tokenizer, "eos_token_id", None)
        self.scheduler = Scheduler(config.num_slots, config.max_seq_len, config.max_prefill_tokens, config.reorder,
                                   config.prefill)
        self.sampler = Sampler(self.eos_token_id)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._aborted: list[Request] = []
        self.num_steps = {"prefill": 0, "decode": 0, "mixed": 0}

    # --- requests ---------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None) -> Request:
        """Tokenize and validate a request without queueing it (reads no engine state: any thread may call it).

        ``params.max_tokens=None`` becomes the rest of the context (``max_seq_len - len(prompt)``).
        Raises ``InvalidParamError`` (a ValueError) naming the parameter: token ids outside the vocabulary, an
        empty prompt, a prompt plus ``max_tokens`` longer than ``max_seq_len``, ids in ``logit_bias``/``stop``
        outside the vocabulary, ``top_k`` above it.
        """
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model_config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidParamError("prompt", f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise InvalidParamError("prompt", "prompt must contain at least one token")
        params.check_vocab(vocab)
        limit = self.config.max_seq_len
        if params.max_tokens is None:
            if len(ids) >= limit:
                raise InvalidParamError("prompt", f"prompt ({len(ids)} tokens) leaves no room for output within "
                                                  f"max_seq_len={limit}")
            params = dataclasses.replace(params, max_tokens=limit - len(ids))
        elif len(ids) + params.max_tokens > limit:
            raise InvalidParamError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                                                  f"{len(ids) + params.max_tokens} exceeds max_seq_len={limit}")
        return Request(request_id if request_id is not None else f"req-{next(self._ids)}", ids, params)

    def add(self, req: Request) -> str:
        """Queue a request made by ``make_request``; returns its id. Raises ValueError if the id is in use."""
        rid = req.request_id
        if rid in self._requests:
            raise InvalidParamError("request_id", f"request_id {rid!r} is already in use")
        self.scheduler.add_request(req)
        self._requests[rid] = req
        if req.params.detokenize:
            self._detok[rid] = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.params.stop)
        return rid

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids); returns its id. Raises ValueError as ``make_request`` does."""
        return self.add(self.make_request(prompt, params, request_id))

    def abort(self, request_id: str) -> None:
        """Stop a request now (client went away); it is reported once with finish_reason 'abort'."""
        req = self._requests.get(request_id)
        if req is not None and req.finish_reason is None:
            self.scheduler.finish(req, "abort")
            self._aborted.append(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # --- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Prefill newly admitted requests, then one fused decode of all running ones; outputs per request."""
        outs: dict[str, RequestOutput] = {}
        for req in self._aborted:
            outs[req.request_id] = self._output(req, [])
        self._aborted.clear()
        if self.config.prefill == "chunked":  # one mixed plan: decode rows + prompt chunks under the budget
            plan = self.scheduler.schedule_mixed()
            if plan is not None:
                self.num_steps["mixed" if plan.is_prefill and plan.n else "prefill" if plan.is_prefill
                               else "decode"] += 1
                self._apply(plan, *self._forward(plan, outs), outs)
            return list(outs.values())
        plan = self.scheduler.schedule_prefill()
        if plan is not None:
            self.num_steps["prefill"] += 1
            self._apply(plan, *self._forward(plan, outs), outs)
        plan = self.scheduler.schedule_decode()
        if plan is not None:
            self.num_steps["decode"] += 1
            self._apply(plan, *self._forward(plan, outs), outs)
        return list(outs.values())

    def _forward(self, plan: StepPlan, outs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the plan's last positions ``[rows, vocab]`` and, for prompt logprobs, of every position."""
        try:
            logits = self.executor.execute(plan)
        except Exception as exc:
            if is_engine_fault(exc) or not self.executor.retry_safe:
                raise
            log.warning("a forward of %d requests failed (%r); running each alone", len(plan.requests), exc)
            logits = self._forward_each(plan, outs)
        if logits.dim() == 3:  # prefill with prompt logprobs: [rows, T, vocab]
            last = torch.tensor([len(t) - 1 for t in plan.prefill_tokens], device=logits.device)
            return logits[torch.arange(logits.shape[0], device=logits.device), last], logits
        return logits, None

    def _forward_each(self, plan: StepPlan, outs: dict) -> torch.Tensor:
        """The plan's rows one at a time; a row whose forward still raises fails its request alone."""
        got: list[torch.Tensor | None] = []
        for i, req in enumerate(plan.requests):
            if req is None:
                got.append(None)
                continue
            try:
                # a copy: a CUDA-graph forward returns a view of the graph's output, which the next row's
                # replay of the same graph would overwrite
                got.append(self.executor.execute(plan.single(i))[0].clone())
            except Exception as exc:
                if is_engine_fault(exc):
                    raise
                self._fail(req, exc, outs)
                got.append(None)
        like = next((g for g in got if g is not None), None)
        if like is None:  # every row failed: nothing to sample
            shape = (len(got), max(map(len, plan.prefill_tokens))) if plan.prompt_logprobs else (len(got),)
            return torch.zeros(*shape, self.model_config.vocab_size)
        if like.dim() == 2:  # prompt logprobs: pad each row's [T_i, vocab] to the longest prompt
            T = max(map(len, plan.prefill_tokens))
            out = like.new_zeros(len(got), T, like.shape[-1])
            for i, g in enumerate(got):
                if g is not None:
                    out[i, : g.shape[0]] = g
            return out
        return torch.stack([g if g is not None else torch.zeros_like(like) for g in got])

    def _apply(self, plan: StepPlan, logits: torch.Tensor, full: torch.Tensor | None, outs: dict) -> None:
        rows = [r if r is not None and r.finish_reason is None else None for r in plan.sampled()]
        res = self.sampler.sample(logits, rows)
        for i, exc in res.errors.items():
            self._fail(rows[i], exc, outs)
            rows[i] = None
        first: dict[str, list] = {}  # prompt logprobs, on each request's first output
        if full is not None:
            for i, req in enumerate(rows):
                if req is not None and req.params.prompt_logprobs is not None:
                    try:
                        first[req.request_id] = prompt_logprobs(full[i], req.prompt_ids, req.params.prompt_logprobs)
                    except Exception as exc:  # noqa: BLE001 - this request fails alone
                        self._fail(req, exc, outs)
        new_lp = {r.request_id: lp for r, lp in zip(rows, res.logprobs) if r is not None and lp is not None}
        for req in self.scheduler.update(plan, res.tokens, self.eos_token_id):
            try:
                lp = new_lp.get(req.request_id)
                if lp is not None:
                    req.cumulative_logprob += lp.logprob
                self._detokenize(req)
                prev = outs.get(req.request_id)
                outs[req.request_id] = self._output(req, [req.output_ids[-1]], lp, first.get(req.request_id), prev)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                self._fail(req, exc, outs)

    def _detokenize(self, req: Request) -> None:
        """Append the newest token's text; a stop string found there finishes the request as 'stop' (also when
        the same token reached max_tokens). Stop strings count once ``min_tokens`` tokens exist (vLLM)."""
        det = self._detok.get(req.request_id)
        tok = req.output_ids[-1]
        if det is None or tok == self.eos_token_id or tok in req.params.stop_token_ids:
            return
        if det.add(tok, check_stop=len(req.output_ids) >= req.params.min_tokens):
            self.scheduler.finish(req, "stop")

    def _fail(self, req: Request, exc: BaseException, outs: dict) -> None:
        """Finish ``req`` with finish_reason 'error' and its error; the engine goes on with the others."""
        log.error("request %s failed: %r", req.request_id, exc, exc_info=exc)
        req.error = f"{type(exc).__name__}: {exc}"
        self.scheduler.finish(req, "error")
        self._requests.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)
        self.sampler.release(req.request_id)
        outs[req.request_id] = RequestOutput(req.request_id, len(req.prompt_ids), list(req.output_ids), [], "", "",
                                             True, "error", req.arrival, req.first_token_time, req.finish_time,
                                             error=req.error)

    def _output(self, req: Request, new: list[int], lp: TokenLogprob | None = None,
                first: list | None = None, prev: RequestOutput | None = None) -> RequestOutput:
        done = req.finish_reason is not None
        det = self._detok.get(req.request_id)
        if det is not None and done and req.finish_reason != "stop":
            det.flush()
        delta = det.delta(final=done) if det is not None else ""
        if done:
            self._requests.pop(req.request_id, None)
            self._detok.pop(req.request_id, None)
            self.sampler.release(req.request_id)
        lps = None
        if req.params.logprobs is not None:  # this step's tokens (a request can get two: prefill, then decode)
            lps = (prev.logprobs if prev is not None and prev.logprobs else []) + ([lp] if lp is not None else [])
        return RequestOutput(req.request_id, len(req.prompt_ids), list(req.output_ids) if done else [],
                             (prev.new_token_ids if prev else []) + new,
                             det.text[:det.sent] if det is not None else "", (prev.delta if prev else "") + delta,
                             done, req.finish_reason, req.arrival, req.first_token_time, req.finish_time,
                             logprobs=lps, prompt_logprobs=first if first is not None else
                             (prev.prompt_logprobs if prev is not None else None),
                             cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None else None)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Offline: run every prompt to completion; final outputs in prompt order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params has {len(plist)} entries for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[i] for i in ids]

    def stats(self) -> dict:
        """Queue length, running requests, KV slots used/total, reorder moves so far; prompt tokens prefilled and
        the positions the prefill forwards computed for them (padding included: equal when packed)."""
        s = self.scheduler
        running = len(s.running)
        return {"waiting": len(s.waiting), "running": running, "kv_slots_used": running,
                "kv_slots_total": s.num_slots, "reorder_moves": s.num_moves, "decode_rows": s.computed_rows,
                "live_rows": s.live_rows, "prefill_tokens": s.prefill_tokens,
                "prefill_positions_computed": s.padded_prefill_tokens}

    def warm_up(self) -> int:
        """Capture, before any request, every CUDA graph the decode (and the packed prefill's token buckets up to
        ``max_prefill_tokens``) can need, with the Triton compiles and the ``fused_gemm="auto"`` choice they
        bring, as vLLM captures at start-up: otherwise the first requests pay them in their TTFT. Call it on an
        idle engine (it writes K/V from slot 0). Returns the number of graphs; 0 without ``cuda_graph`` or with
        tensor parallelism (its ranks capture on first use)."""
        runner = getattr(self.executor, "runner", None)
        if not self.config.cuda_graph or self.config.tensor_parallel_size > 1 or runner is None:
            return 0
        if self.scheduler.running or self.scheduler.waiting:
            raise RuntimeError("warm_up() needs an idle engine: it writes K/V into the slots")
        tokens = self.config.max_prefill_tokens if self.config.prefill != "padded" else None
        return runner.warm_up(prefill_tokens=tokens)

    def shutdown(self) -> None:
        self.executor.shutdown()
