"""Model runner: builds the model and its slot KV cache on one device and runs ``StepPlan`` forwards.

The fused decode step can be replayed from CUDA graphs (one per batch-size and KV-length bucket): at batch
64 a 1B-parameter decode step is memory-bound at about 0.5 ms on an H200, less than the Python launch cost
of its ~300 kernels, so eager mode would be launch-bound.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from dataclasses import dataclass

import torch

from hpdl.models.gpt import Batch, DecoderConfig, DecoderLM, KVCache, load_pretrained
from hpdl.serve.scheduler import StepPlan

# Named random-weight configs for `hpdl serve --config NAME` (vocab 258 = 256 bytes + <bos> + <eos>).
NAMED_CONFIGS: dict[str, DecoderConfig] = {
    "gpt2-tiny": DecoderConfig(arch="gpt2", vocab_size=258, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=4,
                               intermediate_size=256, max_position=1024, bos_token_id=256, eos_token_id=257),
    "llama-tiny": DecoderConfig(arch="llama", vocab_size=258, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                intermediate_size=128, max_position=1024, bos_token_id=256, eos_token_id=257),
    # The benchmark model: TinyLlama-1.1B shape (hidden 2048, 22 layers, 32 heads, 4 KV heads).
    "llama-1b": DecoderConfig(arch="llama", vocab_size=32000, hidden_size=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                              intermediate_size=5632, max_position=2048, bos_token_id=1, eos_token_id=2),
    # The same shape with an 8k context (random weights: only the RoPE table grows), for long-prompt benchmarks.
    "llama-1b-8k": DecoderConfig(arch="llama", vocab_size=32000, hidden_size=2048, n_layers=22, n_heads=32,
                                 n_kv_heads=4, intermediate_size=5632, max_position=8192, bos_token_id=1,
                                 eos_token_id=2),
    # LLaMA-2-7B shape, where weight reads dominate a batch-1 step (the tensor-parallel benchmark).
    "llama-7b": DecoderConfig(arch="llama", vocab_size=32000, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                              intermediate_size=11008, max_position=4096, bos_token_id=1, eos_token_id=2),
}

log = logging.getLogger("hpdl.serve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSpec:
    """Where weights come from: a Hugging Face directory (``model``) or a named random config (``config``)."""

    model: str | None = None
    config: str | None = None
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self):
        if (self.model is None) == (self.config is None):
            raise ValueError("give exactly one of model=DIR or config=NAME")
        if self.config is not None and self.config not in NAMED_CONFIGS:
            raise ValueError(f"config must be one of {sorted(NAMED_CONFIGS)}, got {self.config!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")


def build_model(spec: ModelSpec, device: str | torch.device, group=None) -> DecoderLM:
    """The model of ``spec`` on ``device`` in ``spec.dtype``, TP-sharded over ``group`` (None = whole)."""
    dtype = DTYPES[spec.dtype]
    if spec.model is not None:
        return load_pretrained(spec.model, group=group, dtype=dtype, device=device).eval()
    with torch.device(device):
        model = DecoderLM(NAMED_CONFIGS[spec.config], group)
    return model.init_random(spec.seed).to(dtype).eval()


def memory_estimate(spec: ModelSpec, num_slots: int, max_seq_len: int, tp: int = 1) -> dict[str, int]:
    """Bytes one rank allocates for ``spec``: ``{"weights": ..., "kv": ...}`` (weights in ``spec.dtype``, the
    slot KV cache ``[n_layers, 2, num_slots, max_seq_len, n_kv_heads / tp, head_dim]``), from the named config
    or the directory's ``config.json`` alone, so that a model too big for the machine is refused before
    anything is allocated. Activations and CUDA graphs come on top (a lower bound)."""
    import json
    from pathlib import Path

    if spec.config is not None:
        cfg = NAMED_CONFIGS[spec.config]
    else:
        cfg = DecoderConfig.from_hf(json.loads((Path(spec.model) / "config.json").read_text()))
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.n_layers
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    per_layer = h * (cfg.n_heads * cfg.head_dim) * 2 + h * kv_dim * 2 + h * inter * (3 if cfg.arch == "llama" else 2)
    params = layers * per_layer // tp + cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + (2 * layers + 1) * h
    elt = torch.empty((), dtype=DTYPES[spec.dtype]).element_size()
    kv = layers * 2 * num_slots * max_seq_len * max(1, kv_dim // tp) * elt
    return {"weights": params * elt, "kv": kv}


class ModelRunner:
    """Holds the model and KV cache of one rank; ``execute(plan)`` returns logits ``[rows, vocab]``.

    Args:
        cuda_graph: replay decode steps from CUDA graphs; needs slots anchored at 0 (``reorder='prefix'``).
        fused: decode with ``hpdl.serve.fused`` (Triton kernels, ~9 per layer instead of ~25); None = on CUDA
            for the models it supports (``fused.supports``), eager elsewhere. ``self.fused`` says which runs
            and ``self.fused_reason`` why not.
        fused_gemm: the fused step's GEMMs, "cublas" or "stream" (``hpdl.serve.fused.fused_decode``'s ``gemm``),
            or "auto": each decode batch bucket runs the path measured fastest for its rows on this device
            (``AUTO_PATHS``: hpdl's stream GEMMs with PDL, or cuBLAS). The first CUDA-graph capture of a bucket
            captures both, times them interleaved (``AUTO_ROUNDS`` x ``AUTO_REPS`` replays at the bucket's
            longest KV length) and keeps the faster; once cuBLAS wins at a bucket, every larger bucket takes
            cuBLAS unmeasured (the row threshold). ``self.gemm_choice`` holds the decisions and their times.
            Buckets never captured (no CUDA graphs) run cuBLAS. Where the fused step does not run it is ignored.
        tp_all_reduce: "nccl"; "symm" (torch symmetric-memory one-shot all-reduce for decode); or "hpdl"
            (hpdl.comm's all-reduce: on CUDA the peer-memory kernels, one launch per call at every size; on CPU
            hpdl's tuned algorithms over gloo). "symm" and "hpdl" fall back to the process group's own
            all-reduce when unavailable; ``self.all_reduce`` says which one runs.
    """

    BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    KV_BUCKET = 128

    def __init__(self, model: DecoderLM, num_slots: int, max_seq_len: int, tp_world: int = 1,
                 cuda_graph: bool = False, tp_all_reduce: str = "nccl", fused: bool | None = None,
                 fused_gemm: str = "cublas"):
        from hpdl.serve import fused as fz

        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.all_reduce = "none" if tp_world == 1 else str(torch.distributed.get_backend(model.group))
        if tp_world > 1 and (tp_all_reduce == "hpdl" or (tp_all_reduce == "symm" and self.device.type == "cuda")):
            self.all_reduce = enable_fast_all_reduce(model, num_slots, tp_all_reduce)
        self.cache = KVCache(model.cfg, num_slots, max_seq_len, self.dtype, self.device, tp_world)
        self.cuda_graph = cuda_graph and self.device.type == "cuda"
        self._graphs: dict[tuple[int, int], tuple] = {}
        self._packed_prefill = None
        self._pool = None
        self.graph_error: str | None = None
        self.fused_reason = fz.supports(model)
        if fused and self.fused_reason is not None:
            raise ValueError(f"fused=True but the fused decode cannot run this model: {self.fused_reason}")
        self.fused = bool(fused if fused is not None else self.device.type == "cuda" and self.fused_reason is None)
        if fused_gemm not in fz.GEMMS + ("auto",):
            raise ValueError(f"fused_gemm must be one of {fz.GEMMS + ('auto',)}, got {fused_gemm!r}")
        if fused_gemm == "stream" and not self.fused:
            # the GEMM choice only exists inside the fused step: ignoring it would report eager numbers as stream's
            why = (self.fused_reason if self.fused_reason is not None else
                   "fused_decode=False (--eager-decode)" if fused is False else
                   f"the eager step is the default on {self.device.type}")
            raise ValueError(f"fused_gemm={fused_gemm!r} (--fused-gemm {fused_gemm}) needs the fused decode step, "
                             f"which this engine does not run: {why}; set fused_decode=True (LLaMA on one device) "
                             f"or leave fused_gemm='cublas'")
        self.fused_gemm = fused_gemm
        # "auto": batch bucket -> {"path", "ms": {path: median ms}, "kv_len"} (measured) or {"path", "by":
        # "threshold"}; the smallest bucket where cuBLAS won (larger ones take it unmeasured)
        self.gemm_choice: dict[int, dict] = {}
        self._cublas_from: int | None = None

    # the "auto" candidates: fused_decode keyword arguments per path name
    AUTO_PATHS = {"stream_pdl": dict(gemm="stream", pdl=True, cublas_candidate=False), "cublas": dict(gemm="cublas")}
    AUTO_ROUNDS, AUTO_REPS = 5, 5

    def _path(self, n: int) -> str:
        """The fused step's path (a key of ``AUTO_PATHS``, or "stream") for a decode of ``n`` rows."""
        if self.fused_gemm != "auto":
            return self.fused_gemm
        choice = self.gemm_choice.get(self._bucket(n))
        return choice["path"] if choice is not None else "cublas"

    def _bucket(self, n: int) -> int:
        """The batch bucket (graph rows) of a decode of ``n`` rows."""
        nb = self.BATCH_BUCKETS[bisect.bisect_left(self.BATCH_BUCKETS, n)] if n <= self.BATCH_BUCKETS[-1] else n
        return min(nb, self.cache.num_slots) if n <= self.cache.num_slots else n

    def _decode(self, toks: torch.Tensor, pos: torch.Tensor, start: int, kv_len: int, path: str | None = None):
        """Logits ``[n, vocab]`` of one decode step and, on the fused path, the greedy argmax ``[n]``.
        ``path``: the fused step's path (``AUTO_PATHS`` key or "stream"); None = ``_path(n)``."""
        if self.fused:
            from hpdl.serve.fused import fused_decode

            path = path or self._path(toks.shape[0])
            kw = self.AUTO_PATHS.get(path, dict(gemm=path))
            return fused_decode(self.model, self.cache, toks[:, 0], pos[:, 0], start, kv_len, **kw)
        return self.model(toks, self.cache, Batch(positions=pos, start=start, kv_len=kv_len)), None

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        for src, dst, length in plan.moves:
            self.cache.move(src, dst, length)
        dev = self.device
        if plan.packed and plan.is_prefill:
            logits = self._packed(plan)
            if plan.n == 0:
                return logits
            dec = self._decode_plan(plan)
            out = torch.cat([logits.to(dec.dtype), dec])
            top = getattr(dec, "argmax_tokens", None)
            return with_argmax(out, None if top is None else torch.cat([logits.argmax(-1), top]))
        if plan.is_prefill:
            B, T = len(plan.prefill_tokens), max(map(len, plan.prefill_tokens))
            toks = torch.zeros(B, T, dtype=torch.long)
            for i, t in enumerate(plan.prefill_tokens):
                toks[i, : len(t)] = torch.tensor(t)
            b = Batch(positions=torch.arange(T, device=dev)[None].expand(B, T),
                      slots=torch.tensor(plan.prefill_slots, device=dev),
                      last=torch.tensor([len(t) - 1 for t in plan.prefill_tokens], device=dev),
                      all_positions=plan.prompt_logprobs)
            return self.model(toks.to(dev, non_blocking=True), self.cache, b)
        return self._decode_plan(plan)

    def _packed(self, plan: StepPlan) -> torch.Tensor:
        """The plan's prefill sequences packed (``hpdl.serve.prefill``): logits ``[sequences, vocab]``, or with
        prompt logprobs every position's, right-padded to ``[sequences, T, vocab]`` as the padded path returns."""
        from hpdl.serve.prefill import PackedSeqs, packed_forward

        seqs = PackedSeqs(list(plan.prefill_slots), list(plan.prefill_starts) or [0] * len(plan.prefill_slots),
                          [len(t) for t in plan.prefill_tokens])
        flat = [t for seq in plan.prefill_tokens for t in seq]
        if not plan.prompt_logprobs:  # the serving path: one metadata copy, no host sync, graphs on CUDA
            return self.packed_prefill.forward(flat, seqs)
        toks = torch.tensor(flat, dtype=torch.long)
        logits = packed_forward(self.model, self.cache, toks.to(self.device, non_blocking=True), seqs,
                                all_positions=True)
        cu, T = seqs.cu, max(seqs.lens)
        out = logits.new_zeros(len(seqs.lens), T, logits.shape[-1])
        for i, n in enumerate(seqs.lens):
            out[i, :n] = logits[cu[i]:cu[i + 1]]
        return out

    def _decode_plan(self, plan: StepPlan) -> torch.Tensor:
        dev = self.device
        kv_len = max(plan.decode_positions) + 1
        if self.cuda_graph and plan.start == 0:  # graphs read slots from 0 (a retried single row may not)
            try:
                return self._replay(plan, kv_len)
            except RuntimeError as exc:  # capture unsupported here: keep serving, eagerly, and say so
                log.warning("CUDA graph decode failed (%s); falling back to eager decode", exc)
                self.cuda_graph, self.graph_error = False, repr(exc)[:300]
                torch.cuda.synchronize()
        toks = torch.tensor(plan.decode_tokens, device=dev)[:, None]
        pos = torch.tensor(plan.decode_positions, device=dev)[:, None]
        return with_argmax(*self._decode(toks, pos, plan.start, kv_len))

    @property
    def packed_prefill(self):
        """The packed prefill (``hpdl.serve.prefill.PackedPrefill``: CUDA graphs per token bucket when this runner
        uses graphs), made on first use."""
        if self._packed_prefill is None:
            from hpdl.serve.prefill import PackedPrefill

            self._packed_prefill = PackedPrefill(self.model, self.cache, self.cache.num_slots, self.cuda_graph)
        return self._packed_prefill

    @torch.inference_mode()
    def warm_up(self, max_batch: int | None = None, prefill_tokens: int | None = None) -> int:
        """Capture every CUDA graph a decode of up to ``max_batch`` rows can need (each batch bucket x KV bucket),
        and with ``prefill_tokens`` the packed prefill's graphs of batches up to that many tokens, so no request
        waits for a capture (or the Triton compiles of the fused step) later. Call it before serving: it writes
        K/V into slots from 0. Returns the number of graphs; 0 without graphs."""
        if not self.cuda_graph:
            return 0
        if prefill_tokens:
            self.packed_prefill.capture(prefill_tokens)
        top = min(max_batch or self.cache.num_slots, self.cache.num_slots)
        sizes = sorted({min(b, top) for b in self.BATCH_BUCKETS if b <= top} | {top})
        for nb in sizes:
            for kb in range(self.KV_BUCKET, self.cache.max_seq_len + self.KV_BUCKET, self.KV_BUCKET):
                kb = min(kb, self.cache.max_seq_len)
                self.execute(StepPlan(start=0, n=nb, decode_tokens=[0] * nb, decode_positions=[kb - 1] * nb))
        return len(self._graphs) + (len(self._packed_prefill.graphs) if self._packed_prefill is not None else 0)

    def close(self) -> None:
        """Drop the captured CUDA graphs and wait for the device: a graph that holds NCCL kernels keeps its
        communicator busy, and destroying the process group then waits for it (seen on the H200 pair)."""
        self._graphs.clear()
        self._pool = None
        self._packed_prefill = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.all_reduce == "hpdl":  # hpdl.comm's cache would keep the destroyed group (and its sockets) alive
            import hpdl.comm as hc

            hc.forget_group(self.model.group)

    def _replay(self, plan: StepPlan, kv_len: int) -> torch.Tensor:
        if plan.start != 0:
            raise ValueError("CUDA-graph decode needs the slot range anchored at 0: use reorder='prefix'")
        nb = self._bucket(plan.n)
        kb = min(-(-kv_len // self.KV_BUCKET) * self.KV_BUCKET, self.cache.max_seq_len)
        key = (nb, kb)
        if key not in self._graphs:
            self._graphs[key] = self._capture(nb, kb)
        graph, toks, pos, out, top = self._graphs[key]
        host = torch.zeros(2, nb, dtype=torch.long)
        host[0, : plan.n] = torch.tensor(plan.decode_tokens)
        host[1, : plan.n] = torch.tensor(plan.decode_positions)
        toks.copy_(host[0, :, None], non_blocking=True)
        pos.copy_(host[1, :, None], non_blocking=True)
        graph.replay()
        return with_argmax(out[: plan.n], top[: plan.n] if top is not None else None)

    @contextlib.contextmanager
    def _position0_kept(self, nb: int, other: int = 0):
        """Save positions 0 and ``other`` of the K/V of slots ``[0, nb)`` and put them back on exit, also on an
        exception (on the current stream: the saved copy is taken before, and restored after, whatever runs
        inside)."""
        at = sorted({0, other})
        saved = (self.cache.k[:, :nb, :, at].clone(), self.cache.v[:, :nb, :, at].clone())
        try:
            yield
        finally:
            self.cache.k[:, :nb, :, at], self.cache.v[:, :nb, :, at] = saved

    def _capture(self, nb: int, kb: int):
        """The CUDA graph of bucket ``(nb, kb)``; with "auto", the first capture of a bucket below the cuBLAS
        threshold captures every ``AUTO_PATHS`` path, times them (``_time_captures``) and keeps the fastest."""
        if self.fused_gemm != "auto" or not self.fused or nb in self.gemm_choice:
            return self._capture_path(nb, kb, self._path(nb))
        if self._cublas_from is not None and nb >= self._cublas_from:
            self.gemm_choice[nb] = {"path": "cublas", "by": f"threshold: cuBLAS won at {self._cublas_from} rows"}
            return self._capture_path(nb, kb, "cublas")
        caps, errors = {}, {}
        for name in self.AUTO_PATHS:  # a path that cannot capture here (e.g. a kernel that cannot launch) loses
            try:
                caps[name] = self._capture_path(nb, kb, name)
            except Exception as exc:  # noqa: BLE001 - the other path still serves; all failing raises below
                if isinstance(exc, KeyboardInterrupt) or len(errors) == len(self.AUTO_PATHS) - 1:
                    raise
                errors[name] = repr(exc)[:300]
                log.warning("fused_gemm auto: the %s path failed to capture at %d rows: %r", name, nb, exc)
        ms = self._time_captures(caps, nb, kb) if len(caps) > 1 else {name: float("nan") for name in caps}
        best = min(ms, key=ms.get)
        self.gemm_choice[nb] = {"path": best, "ms": {k: round(v, 4) for k, v in ms.items()}, "kv_len": kb}
        if errors:
            self.gemm_choice[nb]["errors"] = errors
        if best == "cublas":
            self._cublas_from = nb if self._cublas_from is None else min(self._cublas_from, nb)
        log.info("fused_gemm auto: %d rows -> %s (%s)", nb, best, self.gemm_choice[nb]["ms"])
        return caps[best]

    def _time_captures(self, caps: dict, nb: int, kb: int) -> dict[str, float]:
        """Median milliseconds of one replay of each captured graph, all at position ``kb - 1`` (the bucket's
        longest attention), in ``AUTO_ROUNDS`` rounds of ``AUTO_REPS`` replays with the paths interleaved in each
        round. The replays write K/V at positions ``kb - 1`` of slots ``[0, nb)``, restored afterwards."""
        import statistics

        times: dict[str, list[float]] = {name: [] for name in caps}
        with self._position0_kept(nb, kb - 1):
            for _, _, pos, _, _ in caps.values():
                pos.fill_(kb - 1)
            for name, (graph, *_) in caps.items():  # one warm replay each
                graph.replay()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(self.AUTO_ROUNDS):
                for name, (graph, *_) in caps.items():
                    a.record()
                    for _ in range(self.AUTO_REPS):
                        graph.replay()
                    b.record()
                    b.synchronize()
                    times[name].append(a.elapsed_time(b) / self.AUTO_REPS)
        return {name: statistics.median(t) for name, t in times.items()}

    def _capture_path(self, nb: int, kb: int, path: str):
        toks = torch.zeros(nb, 1, dtype=torch.long, device=self.device)
        pos = torch.zeros(nb, 1, dtype=torch.long, device=self.device)
        # warm-up outside the graph (allocator, cuBLAS handles); it writes position 0 of slots [0, nb), which
        # may be live: _position0_kept restores them even when the warm-up raises (a failed capture left
        # requests' first K/V overwritten before, and float32 greedy tokens diverged from eager on the H200).
        s = torch.cuda.Stream()
        with self._position0_kept(nb):
            s.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(s):
                    for _ in range(2):  # also compiles and tunes the Triton kernels for these shapes
                        self._decode(toks, pos, 0, kb, path)
            finally:
                torch.cuda.current_stream().wait_stream(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            out, top = self._decode(toks, pos, 0, kb, path)
        return g, toks, pos, out, top


def with_argmax(logits: torch.Tensor, top: torch.Tensor | None) -> torch.Tensor:
    """Attach the step's greedy tokens (``top [n]``, computed inside the decode step) to its logits as
    ``logits.argmax_tokens``; ``Sampler.sample`` uses them instead of launching its own argmax."""
    if top is not None:
        logits.argmax_tokens = top
    return logits


class SymmAllReduce:
    """One-shot all-reduce over torch symmetric memory for small (decode) tensors, NCCL for the rest.

    At batch 1 a decode step makes two all-reduces per layer of a few KiB each, where NCCL's ~11 us latency
    (measured in a CUDA graph on the H200 pair) is the floor; a one-shot kernel reads every peer's buffer
    over NVLink directly. Two buffers alternate, so a rank that runs ahead never overwrites a buffer a peer
    is still reading (each reduce starts with a barrier, so ranks are at most one reduce apart).
    """

    def __init__(self, group, max_numel: int, dtype, device):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.bufs = [symm_mem.empty(max_numel, dtype=dtype, device=device) for _ in range(2)]
        for b in self.bufs:
            symm_mem.rendezvous(b, self.group_name)
        self.max_numel, self.dtype, self.i = max_numel, dtype, 0

    def __call__(self, y: torch.Tensor) -> torch.Tensor | None:
        if y.numel() > self.max_numel or y.dtype != self.dtype:
            return None
        buf = self.bufs[self.i][: y.numel()]
        self.i ^= 1
        buf.copy_(y.reshape(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group_name).view_as(y)


class HpdlAllReduce:
    """hpdl.comm's all-reduce (``auto``: the peer-memory one-shot / two-shot kernels on one node, one launch per
    call, graph-capturable, bit-identical on every rank; docs/comm.md, "GPUs of one host"), in place, at every size."""

    def __init__(self, group):
        self.group = group

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        import hpdl.comm as hc

        hc.all_reduce(y, group=self.group)
        return y


def enable_fast_all_reduce(model: DecoderLM, max_tokens: int, kind: str = "symm") -> str:
    """Attach ``SymmAllReduce`` (kind "symm") or ``HpdlAllReduce`` (kind "hpdl") to every row-parallel layer if
    it works here on every rank (checked against NCCL, which also registers its buffers before any graph
    capture, and agreed on by all ranks, so they never diverge); returns ``kind`` or "nccl: <reason>"."""
    import torch.distributed as dist

    from hpdl.models.gpt import RowParallelLinear

    if kind not in ("symm", "hpdl"):
        raise ValueError(f"kind must be 'symm' or 'hpdl', got {kind!r}")
    p = next(model.parameters())
    ok, why = 1, ""
    try:
        sar = (SymmAllReduce(model.group, max_tokens * model.cfg.hidden_size, p.dtype, p.device) if kind == "symm"
               else HpdlAllReduce(model.group))
        x = torch.full((4, model.cfg.hidden_size), float(dist.get_rank(model.group) + 1), dtype=p.dtype,
                       device=p.device)
        ref = x.clone()   # before sar: the hpdl all-reduce works in place
        dist.all_reduce(ref, group=model.group)
        got = sar(x)
        if not torch.equal(got, ref):
            ok, why = 0, "result differs from NCCL"
    except Exception as exc:  # noqa: BLE001 - any failure means: keep NCCL
        ok, why = 0, repr(exc)[:200]
    flag = torch.tensor([ok], device=p.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=model.group)
    if not flag.item():
        return f"nccl: {why or 'a peer could not use symmetric memory'}"
    if kind == "symm":
        sar.i = 0
    for m in model.modules():
        if isinstance(m, RowParallelLinear):
            m.fast_all_reduce = sar
    return kind
