"""`hpdl serve`: start the OpenAI-compatible server; `hpdl serve bench`: the serving benchmark client."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time

from hpdl.bench.common import Benchmark, Column, command
from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.limits import count, real


def _range(text: str) -> tuple[int, int]:
    """``LO[:HI]`` token counts, 1 <= LO <= HI <= 2**20."""
    lo, _, hi = text.partition(":")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO[:HI] integers, got {text!r}") from None
    if not 1 <= lo <= hi <= 1 << 20:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI <= {1 << 20}, got {text!r}")
    return lo, hi


def _rate(text: str) -> float:
    """Requests per second: a positive number, or ``inf`` (every request at t = 0)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if not value > 0:   # NaN included
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return value


class _HelpWithDefaults(argparse.HelpFormatter):
    """Appends ``(default: X)`` to every option that has a meaningful default (not None or False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("%(default)" in text or "(default:" in text or not action.option_strings
                or action.default in (None, False, argparse.SUPPRESS)):
            return text
        return text + " (default: %(default)s)"


def _config_help() -> str:
    """One entry per named config, generated from the table (``hpdl.serve.worker.NAMED_CONFIGS``)."""
    from hpdl.serve.worker import NAMED_CONFIGS

    return "named random-weight model (no download): " + ", ".join(
        f"{name} ({c.arch}, {c.n_layers} x {c.hidden_size}, vocab {c.vocab_size})" for name, c in NAMED_CONFIGS.items())


def _prefill_modes(text: str) -> list[str]:
    """A comma list of prefill modes (``hpdl.serve.scheduler.PREFILL_MODES``), each once."""
    from hpdl.serve.scheduler import PREFILL_MODES

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in PREFILL_MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"expected a comma list of distinct modes among {', '.join(PREFILL_MODES)}, "
                                         f"got {text!r}")
    return modes


def _model_args(p: argparse.ArgumentParser, bench: bool = False) -> None:
    from hpdl.serve.worker import NAMED_CONFIGS

    p.formatter_class = _HelpWithDefaults
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", metavar="DIR",
                   help="Hugging Face format directory (config.json + *.safetensors), GPT-2 or Llama")
    g.add_argument("--config", metavar="NAME", choices=list(NAMED_CONFIGS), help=_config_help())
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights and KV")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    g.add_argument("--num-slots", type=count(1, 1 << 16), default=64, help="pre-allocated KV slots = max concurrent requests")
    g.add_argument("--max-seq-len", type=count(2, 1 << 24), default=1024, help="prompt + output positions per slot")
    g.add_argument("--tensor-parallel-size", type=count(1, 64), default=1, help="ranks of one model (processes on this host)")
    g.add_argument("--reorder", default="window", choices=["window", "prefix", "none"],
                   help="buffer reordering: window (Flover), prefix (anchored at slot 0), none")
    g.add_argument("--tp-all-reduce", default="nccl", choices=["nccl", "symm", "hpdl"],
                   help="symm: torch's one-shot symmetric-memory all-reduce for decode steps; hpdl: hpdl.comm's "
                        "peer-memory all-reduce at every size (CUDA, one node); NCCL otherwise")
    g.add_argument("--cuda-graph", action="store_true", help="replay decode steps from CUDA graphs")
    g.add_argument("--eager-decode", action="store_true",
                   help="decode with the eager model, not the fused Triton step (the default on CUDA for LLaMA)")
    g.add_argument("--fused-gemm", default="cublas", choices=["cublas", "stream", "auto"],
                   help="GEMMs of the fused decode step: cuBLAS, hpdl's weight-streaming Triton GEMMs with the "
                        "residual add, SiLU-mul and RMSNorm fused in (hpdl.serve.stream_gemm), or auto: per decode "
                        "batch bucket the one measured faster on the device at CUDA-graph capture")
    g.add_argument("--seed", type=count(0, 2**63 - 1), default=0, help="random-weight seed (and workload seed for bench)")
    if bench:
        g.add_argument("--prefill", type=_prefill_modes, default="packed",
                       help="prefill path, or a comma list run one after another and reported side by side "
                            "(flover/MODE): padded (prompts padded to the longest), packed (the default: no padding, one "
                            "varlen attention launch per layer), chunked (packed, split into chunks mixed into decode steps)")
    else:
        g.add_argument("--prefill", default="packed", choices=["padded", "packed", "chunked"],
                       help="padded (prompts padded to the longest), packed (the default: no padding, one varlen "
                            "attention launch per layer), chunked (packed, split into chunks mixed into decode steps under "
                            "--max-num-batched-tokens)")
    g.add_argument("--max-num-batched-tokens", type=count(1, 1 << 24), default=8192,
                   help="prefill token budget: padded tokens of a prefill batch (padded), prompt tokens (packed), or "
                        "decode rows + prompt-chunk tokens of a step (chunked; must exceed --num-slots)")


def _engine(args, prefill: str | None = None):
    import torch

    from hpdl.serve import EngineConfig, LLMEngine, ModelSpec

    if (args.model is None) == (args.config is None):
        raise CLIUsageError("give exactly one of --model DIR or --config NAME")
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        raise CLIUsageError(f"--device {args.device}: CUDA is not available on this machine (torch "
                            f"{torch.__version__}, {torch.cuda.device_count()} GPUs visible); use --device cpu")
    if args.fused_gemm == "stream" and (args.eager_decode or not str(args.device).startswith("cuda")):
        raise CLIUsageError("--fused-gemm stream is the fused decode step's GEMM: it needs --device cuda and no "
                            "--eager-decode")
    prefill = prefill or args.prefill
    if prefill == "chunked" and args.max_num_batched_tokens <= args.num_slots:
        raise CLIUsageError(f"--prefill chunked needs --max-num-batched-tokens > --num-slots ({args.num_slots}): each "
                            f"decoding request takes one token of a step's budget, prompt chunks the rest; got "
                            f"{args.max_num_batched_tokens}")
    spec = ModelSpec(model=args.model, config=args.config, seed=args.seed, dtype=args.dtype)
    _check_memory(spec, args)
    cfg = EngineConfig(num_slots=args.num_slots, max_seq_len=args.max_seq_len, device=args.device,
                       tensor_parallel_size=args.tensor_parallel_size, reorder=args.reorder,
                       cuda_graph=args.cuda_graph, tp_all_reduce=args.tp_all_reduce,
                       fused_decode=False if args.eager_decode else None, fused_gemm=args.fused_gemm,
                       prefill=prefill, max_prefill_tokens=args.max_num_batched_tokens)
    engine = LLMEngine(spec, cfg)
    if args.cuda_graph:   # capture before serving: the first requests must not pay it in their TTFT
        t0 = time.monotonic()
        n = engine.warm_up()
        print(f"# captured {n} CUDA graphs in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return spec, engine


def _check_memory(spec, args) -> None:
    """A model or KV cache too big for the host (or GPU) fails here, naming the flag, instead of after a silent
    half minute in an allocator (issue 37: `--config llama-7b` on a small host)."""
    from hpdl.runtime.limits import check_fits
    from hpdl.serve.worker import memory_estimate

    try:
        est = memory_estimate(spec, args.num_slots, args.max_seq_len, args.tensor_parallel_size)
    except (OSError, KeyError, ValueError):   # an unreadable config.json: the loader reports it with context
        return
    device = "cuda" if str(args.device).startswith("cuda") else "cpu"
    ranks = args.tensor_parallel_size if device == "cpu" else 1   # CPU ranks share the host
    name = args.model or args.config
    try:
        check_fits(ranks * est["weights"], "--model/--config/--dtype", device=args.device,
                   what=f"{name}'s weights in {args.dtype}" + (f" on {ranks} ranks" if ranks > 1 else ""))
        check_fits(ranks * (est["weights"] + est["kv"]), "--num-slots/--max-seq-len", device=args.device,
                   what=f"{name} with a KV cache of {args.num_slots} slots x {args.max_seq_len} positions")
    except MemoryError as exc:
        raise CLIUsageError(str(exc)) from None


# the rows' columns, in the order the table prints them: (key, header, unit)
_METRICS = (("requests", "requests", ""), ("output_throughput", "output throughput", "tok/s"),
            ("request_throughput", "request throughput", "req/s"), ("mean_ttft_ms", "TTFT mean", "ms"),
            ("median_ttft_ms", "TTFT median", "ms"), ("p99_ttft_ms", "TTFT p99", "ms"),
            ("median_tpot_ms", "TPOT median", "ms"), ("mean_tpot_ms", "TPOT mean", "ms"),
            ("p99_tpot_ms", "TPOT p99", "ms"), ("p99_itl_ms", "ITL p99", "ms"),
            ("median_e2el_ms", "E2EL median", "ms"), ("p99_e2el_ms", "E2EL p99", "ms"),
            ("goodput", "goodput", "req/s"), ("makespan_s", "makespan", "s"),
            ("prefill_padding", "prefill padding", "tokens"))


def _system_cell(row: dict) -> str:
    return row["system"] + (" *" if row.get("note") else "")


class ServeBenchmark(Benchmark):
    """``hpdl serve bench`` (also ``hpdl bench serve``) on the harness: one row per system (``flover``, or
    ``flover/MODE`` per ``--prefill`` path, then the baselines ``sequential``, ``static``, ``cb``; ``server`` with
    ``--url``) with :func:`hpdl.serve.bench.summarize`'s metrics; in-process, the JSON's ``roofline`` section and
    the line under the table compare a decode step with the measured copy bandwidth
    (:func:`hpdl.serve.bench.decode_roofline`)."""

    name, stem = "serve", "serve_bench"
    title = "serving: TTFT/TPOT/ITL/E2EL, throughput, goodput"
    help = "serving benchmark: TTFT/TPOT/ITL/E2EL, throughput, goodput; vs HF generate/static/continuous batching"
    columns = (Column(_system_cell, "system", fmt=str),
               *(Column(k, h, u, fmt=(str if k in ("requests", "prefill_padding") else ".4g"))
                 for k, h, u in _METRICS))

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        _model_args(p, bench=True)
        p.add_argument("--url", help="benchmark a running server at this base URL instead of in-process")
        p.add_argument("--served-model", "--served-model-name", dest="served_model", default=None,
                       help="model name to send with --url (the server's --served-model-name; vLLM's bench spells "
                            "it --served-model-name too)")
        p.add_argument("--num-requests", type=count(1, 1 << 20), default=64, help="requests in the workload")
        p.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s (inf = all at t=0)")
        p.add_argument("--burstiness", type=real(0, 1e6, strict=True), default=1.0, help="gamma shape; 1 = Poisson, < 1 burstier")
        p.add_argument("--prompt-len", type=_range, default="128", help="LO[:HI] tokens, uniform")
        p.add_argument("--output-len", type=_range, default="32:512", help="LO[:HI] tokens, uniform")
        p.add_argument("--corpus", help="local text file: prompts are slices of it instead of random ids")
        p.add_argument("--systems", default="flover,sequential,static,cb",
                       help="comma list of flover, sequential, static, cb (in-process only)")
        p.add_argument("--static-batch-size", type=count(1, 1 << 16), default=16, help="batch of the static baseline")
        p.add_argument("--max-concurrency", type=count(1, 1 << 20), default=None, help="--url only: cap on in-flight requests")
        p.add_argument("--slo-ttft-ms", type=real(0, strict=True), default=None, help="goodput: TTFT bound (none if unset)")
        p.add_argument("--slo-tpot-ms", type=real(0, strict=True), default=None, help="goodput: TPOT bound (none if unset)")

    def validate(self, args) -> None:
        self.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        known = ("flover", "sequential", "static", "cb")
        bad = [s for s in self.systems if s not in known]
        if bad or not self.systems:
            raise CLIUsageError(f"--systems: a comma list among {', '.join(known)}, got {args.systems!r}")
        if not args.url:
            # before the engine is built: the engine would reject the first too-long request at run time
            longest = args.prompt_len[1] + args.output_len[1]
            if longest > args.max_seq_len:
                raise CLIUsageError(f"--prompt-len up to {args.prompt_len[1]} + --output-len up to "
                                    f"{args.output_len[1]} = {longest} positions exceed --max-seq-len "
                                    f"{args.max_seq_len}")

    def metadata(self, args) -> dict:
        workload = {k: getattr(args, k) for k in ("num_requests", "request_rate", "burstiness", "prompt_len",
                                                   "output_len", "corpus", "seed")}
        workload["request_rate"] = str(args.request_rate)   # inf is not JSON
        if args.url:
            return {"device": None, "url": args.url, "served_model": args.served_model, "workload": workload}
        engine = {k: getattr(args, k) for k in ("model", "config", "dtype", "num_slots", "max_seq_len",
                                                 "tensor_parallel_size", "reorder", "tp_all_reduce", "cuda_graph",
                                                 "eager_decode", "fused_gemm", "prefill", "max_num_batched_tokens")}
        return {"device": args.device, "engine": engine, "workload": workload, "systems": self.systems,
                "static_batch_size": args.static_batch_size, "versions": ("transformers",)}

    def run(self, ctx) -> list[dict]:
        from hpdl.serve import bench

        args = ctx.args
        corpus = None
        if args.corpus:
            from hpdl.serve.tokenizer import load_tokenizer

            with open(args.corpus, encoding="utf-8", errors="replace") as fh:
                corpus = load_tokenizer(args.model).encode(fh.read())
        if args.url:
            wl = bench.make_workload(args.num_requests, args.prompt_len, args.output_len, args.request_rate,
                                     args.burstiness, vocab_size=256, corpus_ids=corpus, seed=args.seed)
            recs = asyncio.run(bench.run_http(args.url.rstrip("/"), args.served_model, wl, args.max_concurrency))
            return [{"system": "server", **bench.summarize(recs, args.slo_ttft_ms, args.slo_tpot_ms)}]
        from hpdl.serve.baselines import compare, hf_model

        modes = args.prefill if isinstance(args.prefill, list) else [args.prefill]
        results: dict[str, dict] = {}
        runs = len(modes) if "flover" in self.systems else 0
        with ctx.progress(runs * args.num_requests, "flover requests") as bar:
            for k, mode in enumerate(modes):  # one engine per prefill path, on the same workload
                spec, engine = _engine(args, mode)
                try:
                    wl = bench.make_workload(args.num_requests, args.prompt_len, args.output_len, args.request_rate,
                                             args.burstiness, engine.model_config.vocab_size, corpus, args.seed)
                    run = self.systems if k == 0 else [s for s in self.systems if s == "flover"]
                    hf = hf_model(spec, engine.model_config, args.device) if set(run) - {"flover"} else None
                    res = compare(engine, hf, wl, run, args.static_batch_size, args.slo_ttft_ms, args.slo_tpot_ms,
                                  progress=lambda: bar.advance(f"flover ({mode}): requests done"))
                    if "flover" in res:
                        st = engine.stats()
                        res["flover"]["prefill_padding"] = st["prefill_positions_computed"] - st["prefill_tokens"]
                        if len(modes) > 1:
                            res = {(f"flover/{mode}" if name == "flover" else name): r for name, r in res.items()}
                    results |= res
                    if "flover" in self.systems and "roofline" not in ctx.extra:  # decode against bandwidth
                        kv = int(sum(len(w.prompt) + w.output_len / 2 for w in wl) / len(wl))
                        roof = bench.decode_roofline(engine, min(len(wl), args.num_slots), kv)
                        if roof is not None:
                            ctx.extra["roofline"] = roof
                finally:
                    engine.shutdown()
        # this engine's rows (one per prefill path) first, then the baselines
        order = sorted(results, key=lambda name: not name.startswith("flover"))
        return [{"system": name, **results[name]} for name in order]

    def table(self, rows, ctx) -> str:
        """The harness's table, then a ``* system: note`` line per row with a note and the roofline line."""
        from hpdl.serve.bench import roofline_line

        text = super().table(rows, ctx)
        notes = [f"* {r['system']}: {r['note']}" for r in rows if r.get("note")]
        roof = ctx.extra.get("roofline")
        return "\n".join([text, *notes] + ([roofline_line(roof)] if roof else []))

    def plot(self, rows, path, ctx) -> list[str]:
        """Bars per system: output throughput (tok/s) and TTFT (median and p99, ms)."""
        from pathlib import Path

        from hpdl.bench.common import pyplot

        target = Path(path) / f"{self.stem}.png" if Path(path).is_dir() else Path(path)
        plt = pyplot()
        names = [r["system"] for r in rows]
        fig, (a, b) = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(rows) + 4), 4))
        a.bar(names, [r["output_throughput"] for r in rows], color="C0")
        a.set_ylabel("output throughput (tok/s)")
        x = range(len(rows))
        b.bar([i - 0.2 for i in x], [r.get("median_ttft_ms", 0) for r in rows], 0.4, label="median")
        b.bar([i + 0.2 for i in x], [r.get("p99_ttft_ms", 0) for r in rows], 0.4, label="p99")
        b.set_xticks(list(x), names)
        b.set_ylabel("TTFT (ms)")
        b.legend(fontsize=8)
        for ax in (a, b):
            ax.tick_params(axis="x", labelrotation=20)
            ax.grid(True, axis="y", alpha=0.3)
        fig.suptitle(self.plot_title(ctx), fontsize=10)
        fig.tight_layout()
        fig.savefig(target, dpi=120)
        plt.close(fig)
        return [str(target)]


ServeBenchCommand = command(ServeBenchmark)
ServeBenchCommand.help = ServeBenchmark.help
ServeBenchCommand.__doc__ = "`hpdl serve bench` (alias `hpdl bench serve`): :class:`ServeBenchmark` on the harness."


class ServeCommand:
    """`hpdl serve --model DIR | --config NAME`: OpenAI-compatible server (Flover engine)."""

    name = "serve"
    help = "OpenAI-compatible LLM server with Flover temporal fusion (see docs/serve.md); `serve bench` benchmarks"

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        _model_args(p)
        p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
        p.add_argument("--port", type=count(0, 65535), default=8000, help="TCP port")
        p.add_argument("--served-model-name", default=None, help="name in /v1/models (default: the dir or config)")
        p.add_argument("--default-max-tokens", type=count(1, 1 << 24), default=16,
                       help="max_tokens of a completion request without one (OpenAI's 16); a chat request without "
                            "one may fill the context")
        sub = p.add_subparsers(dest="serve_cmd", metavar="{bench}")
        b = sub.add_parser("bench", help=ServeBenchCommand.help, description=ServeBenchCommand.help,
                           formatter_class=_HelpWithDefaults)
        ServeBenchCommand.add_arguments(b)

    def run(self, args) -> int:
        if getattr(args, "serve_cmd", None) == "bench":
            return ServeBenchCommand().run(args)
        from hpdl.serve.api_server import run_server
        from hpdl.serve.async_engine import AsyncEngine
        from hpdl.serve.metrics import ServeMetrics

        spec, engine = _engine(args)
        name = args.served_model_name or args.config or os.path.basename(os.path.normpath(args.model))
        metrics = ServeMetrics()
        print(f"hpdl serve: {name} on http://{args.host}:{args.port} (slots={args.num_slots}, "
              f"tp={args.tensor_parallel_size}, device={args.device})", flush=True)
        if args.config:   # say it before the first reply does: random bytes, possibly an immediate <eos>
            print(f"hpdl serve: {args.config} has random weights (seed {args.seed}): replies are random bytes and "
                  "may stop at once on end-of-sequence; send \"min_tokens\": N to get at least N of them, "
                  "or serve real weights with --model DIR", flush=True)
        run_server(AsyncEngine(engine, metrics), name, metrics, args.host, args.port, args.default_max_tokens)
        return 0
