"""The Flover engine: one loop of schedule -> execute -> sample -> update (vLLM v1's ``EngineCore.step``).

Each ``step()`` first prefills newly admitted requests as one padded batch (Flover's pre-processing stage),
then runs ONE fused decode forward over every running request (temporal fusion). Requests join between
steps and leave the moment they finish; their slots are reclaimed by buffer reordering before the next
forward. Not thread-safe: ``AsyncEngine`` drives it from a single thread.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from hpdl.serve.executor import RunnerArgs, TPExecutor, UniprocExecutor
from hpdl.serve.sampling import Sampler, SamplingParams
from hpdl.serve.scheduler import Request, Scheduler, StepPlan
from hpdl.serve.tokenizer import IncrementalDetokenizer, load_tokenizer
from hpdl.serve.worker import ModelSpec


@dataclass
class EngineConfig:
    """Engine knobs (vLLM names in brackets).

    num_slots: pre-allocated KV slots, the most requests decoded together [max_num_seqs].
    max_seq_len: positions per slot, prompt + output [max_model_len].
    max_prefill_tokens: padded tokens per batched prefill [max_num_batched_tokens].
    reorder: "window" (Flover), "prefix" (anchored at slot 0; forced with CUDA graphs) or "none".
    tp_all_reduce: "nccl", "symm" (torch's one-shot symmetric-memory all-reduce for decode on CUDA) or "hpdl"
        (hpdl.comm's peer-memory all-reduce on CUDA, every size); NCCL where the fast one is unavailable.
    """

    num_slots: int = 64
    max_seq_len: int = 1024
    max_prefill_tokens: int = 8192
    reorder: str = "window"
    tensor_parallel_size: int = 1
    device: str = "cpu"
    cuda_graph: bool = False
    tp_all_reduce: str = "nccl"

    def __post_init__(self):
        if self.tp_all_reduce not in ("nccl", "symm", "hpdl"):
            raise ValueError(f"tp_all_reduce must be 'nccl', 'symm' or 'hpdl', got {self.tp_all_reduce!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.cuda_graph:
            self.reorder = "prefix"


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request.

    ``new_token_ids``: tokens of this step; ``token_ids``: all output tokens, filled on the final output only (a
    copy per step would cost O(length) per token). ``delta``: text not sent before; ``text``: all sent so far.
    Times are ``time.perf_counter()`` seconds.
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


class LLMEngine:
    """Serve many generation requests with one fused decode step per iteration.

    Example:
        >>> eng = LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=4, max_seq_len=64))
        >>> [o.token_ids for o in eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3))][0].__len__()
        3
    """

    def __init__(self, spec: ModelSpec, config: EngineConfig | None = None, tokenizer=None):
        self.config = config = config or EngineConfig()
        args = RunnerArgs(config.num_slots, config.max_seq_len, config.device, config.cuda_graph, config.tp_all_reduce)
        self.executor = UniprocExecutor(spec, args) if config.tensor_parallel_size == 1 else \
            TPExecutor(spec, args, config.tensor_parallel_size)
        self.model_config = self.executor.config
        self.tokenizer = tokenizer or load_tokenizer(spec.model)
        eos = self.model_config.eos_token_id
        self.eos_token_id = eos if eos is not None else getattr(self.tokenizer, "eos_token_id", None)
        self.scheduler = Scheduler(config.num_slots, config.max_seq_len, config.max_prefill_tokens, config.reorder)
        self.sampler = Sampler()
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._aborted: list[Request] = []
        self.num_steps = {"prefill": 0, "decode": 0}

    # --- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids); returns its id. Raises ValueError for a bad prompt or id."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        req = Request(rid, ids, params)
        self.scheduler.add_request(req)
        self._requests[rid] = req
        if params.detokenize:
            self._detok[rid] = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        return rid

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
        plan = self.scheduler.schedule_prefill()
        if plan is not None:
            self.num_steps["prefill"] += 1
            self._apply(plan, self.executor.execute(plan), outs)
        plan = self.scheduler.schedule_decode()
        if plan is not None:
            self.num_steps["decode"] += 1
            self._apply(plan, self.executor.execute(plan), outs)
        return list(outs.values())

    def _apply(self, plan: StepPlan, logits: torch.Tensor, outs: dict[str, RequestOutput]) -> None:
        rows = [(r.request_id, r.params) if r is not None else None for r in plan.requests]
        tokens = self.sampler.sample(logits, rows)
        for req in self.scheduler.update(plan, tokens, self.eos_token_id):
            det = self._detok.get(req.request_id)
            tok = req.output_ids[-1]
            if det is not None and tok != self.eos_token_id and tok not in req.params.stop_token_ids:
                if det.add(tok) and req.finish_reason is None:
                    self.scheduler.finish(req, "stop")
            prev = outs.get(req.request_id)
            outs[req.request_id] = self._output(req, (prev.new_token_ids if prev else []) + [tok], prev)

    def _output(self, req: Request, new: list[int], prev: RequestOutput | None = None) -> RequestOutput:
        done = req.finish_reason is not None
        det = self._detok.get(req.request_id)
        if det is not None and done and req.finish_reason != "stop":
            det.flush()
        delta = det.delta(final=done) if det is not None else ""
        if done:
            self._requests.pop(req.request_id, None)
            self._detok.pop(req.request_id, None)
            self.sampler.release(req.request_id)
        return RequestOutput(req.request_id, len(req.prompt_ids), list(req.output_ids) if done else [], new,
                             det.text[:det.sent] if det is not None else "", (prev.delta if prev else "") + delta,
                             done, req.finish_reason, req.arrival, req.first_token_time, req.finish_time)

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
        """Queue length, running requests, KV slots used/total, reorder moves so far."""
        s = self.scheduler
        running = len(s.running)
        return {"waiting": len(s.waiting), "running": running, "kv_slots_used": running,
                "kv_slots_total": s.num_slots, "reorder_moves": s.num_moves, "decode_rows": s.computed_rows, "live_rows": s.live_rows}

    def shutdown(self) -> None:
        self.executor.shutdown()
