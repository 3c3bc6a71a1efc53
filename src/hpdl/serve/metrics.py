"""Prometheus metrics of the server (names follow vLLM's ``vllm:*`` metrics with an ``hpdl_`` prefix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class ServeMetrics:
    """Gauges (queue, running, KV slots) and TTFT/TPOT/E2E histograms in seconds, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.waiting = Gauge("hpdl_num_requests_waiting", "Requests queued, not yet prefilled", registry=r)
        self.running = Gauge("hpdl_num_requests_running", "Requests in the fused decode batch", registry=r)
        self.slots_used = Gauge("hpdl_kv_slots_used", "Pre-allocated KV slots held by requests", registry=r)
        self.slots_total = Gauge("hpdl_kv_slots_total", "Pre-allocated KV slots", registry=r)
        self.moves = Gauge("hpdl_reorder_moves", "Slot moves made by buffer reordering so far", registry=r)
        self.ttft = Histogram("hpdl_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("hpdl_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("hpdl_e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.prompt_tokens = Counter("hpdl_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("hpdl_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("hpdl_request_success", "Finished requests", ["finish_reason"], registry=r)

    def on_step(self, stats: dict, outputs) -> None:
        """Update from ``LLMEngine.stats()`` and one step's ``RequestOutput`` list."""
        self.waiting.set(stats["waiting"])
        self.running.set(stats["running"])
        self.slots_used.set(stats["kv_slots_used"])
        self.slots_total.set(stats["kv_slots_total"])
        self.moves.set(stats["reorder_moves"])
        for o in outputs:
            self.generation_tokens.inc(len(o.new_token_ids))
            if not o.finished:
                continue
            self.finished.labels(o.finish_reason or "unknown").inc()
            self.prompt_tokens.inc(o.prompt_tokens)
            if o.first_token_time is None or o.finish_time is None:
                continue
            self.ttft.observe(o.first_token_time - o.arrival)
            self.e2e.observe(o.finish_time - o.arrival)
            if len(o.token_ids) > 1:
                self.tpot.observe((o.finish_time - o.first_token_time) / (len(o.token_ids) - 1))
