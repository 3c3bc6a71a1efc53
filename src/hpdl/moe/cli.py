"""``hpdl moe {trace,affinity,place,train,bench}``: thin wrappers that parse, call hpdl.moe and print."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.limits import count, real


def _text_ids(path: str | None, max_bytes: int) -> tuple["object", str]:
    import numpy as np

    from hpdl.moe.train import stdlib_corpus

    if path:
        b = Path(path).read_bytes()[:max_bytes]
        return np.frombuffer(b, dtype=np.uint8).copy(), f"file:{path}"
    return stdlib_corpus(max_bytes, part="tail")  # held out from `hpdl moe train`, which reads the head


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one (not for required options, nor None)."""

    def _get_help_string(self, action):
        if action.required or action.default is None:
            return action.help
        return super()._get_help_string(action)


class MoECommand:
    """`hpdl moe ...` (ExFlow, arXiv 2401.08383)."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        F = _Help
        sub = parser.add_subparsers(dest="moe_cmd", metavar="{trace,affinity,place,train,bench}")
        t = sub.add_parser("trace", formatter_class=F, help="record every token's experts per MoE layer (npz)")
        t.add_argument("--model", required=True, help="hpdl checkpoint dir (hpdl moe train --out) or a local HF "
                       "Mixtral/Qwen2-MoE/OLMoE dir (byte-level text needs vocab >= 256, else its tokenizer)")
        t.add_argument("--text", default=None, help="text file (default: the tail of the Python stdlib source, "
                       "files `hpdl moe train` does not read)")
        t.add_argument("--tokens", type=count(1), default=16384, help="tokens to trace (rounded down to whole windows)")
        t.add_argument("--seq", type=count(1, 1 << 16), default=128, help="window length in tokens")
        t.add_argument("--out", required=True, help="output .npz")
        a = sub.add_parser("affinity", formatter_class=F, help="affinity statistics vs shuffled baseline, heat maps")
        a.add_argument("trace", help=".npz from `hpdl moe trace`")
        a.add_argument("--plot", default=None, help="PNG of P(expert at l+1 | expert at l) per transition")
        a.add_argument("--json", default=None, help="write the summary here")
        p = sub.add_parser("place", formatter_class=F, help="ILP expert placement; held-out cross-GPU share")
        p.add_argument("trace", help=".npz from `hpdl moe trace`")
        p.add_argument("--world-size", type=count(1, 4096), required=True, help="expert-parallel ranks (GPUs) G; must divide "
                       "the trace's expert count")
        p.add_argument("--ranks-per-node", type=count(1, 4096), default=None, help="ranks per node; adds the inter-node hop "
                       "cost (2x an intra-node hop); default: one node")
        p.add_argument("--method", default="auto",
                       choices=["auto", "ilp", "bisect", "two_stage", "greedy", "contiguous", "random"],
                       help="auto = two_stage with --ranks-per-node < G, else bisect for power-of-two G >= 4, else ilp "
                            "(docs/moe.md, Placement)")
        p.add_argument("--time-limit", type=real(0, 86400, strict=True), default=None, help="seconds for HiGHS, shared by bisection "
                       "(default HPDL_MOE_ILP_TIME_LIMIT, 60)")
        p.add_argument("--train-fraction", type=real(0, 1, strict=True), default=0.5, help="fit on this head of the trace, report "
                       "on the rest")
        p.add_argument("--out", required=True, help="placement JSON for MoEEngine")
        r = sub.add_parser("train", formatter_class=F, help="train a tiny MoE on stdlib source; affinity per checkpoint")
        r.add_argument("--steps", type=count(0), default=1500, help="optimizer steps (AdamW)")
        r.add_argument("--batch", type=count(1, 1 << 16), default=16, help="sequences per step")
        r.add_argument("--seq", type=count(2, 1 << 16), default=128, help="sequence length in bytes (tokens)")
        r.add_argument("--layers", type=count(2, 1024), default=4, help="decoder layers, every one MoE (>= 2: affinity is between layers)")
        r.add_argument("--experts", type=count(1, 4096), default=8, help="routed experts per MoE layer")
        r.add_argument("--hidden", type=count(8, 1 << 16), default=96, help="hidden size (4 heads; a multiple of 8); experts "
                       "have 2x hidden units")
        r.add_argument("--top-k", type=count(1, 4096), default=1, help="experts per token (ExFlow mode needs 1)")
        r.add_argument("--checkpoints", type=count(1, 10_000), default=11, help="evenly spaced steps (0 and the last included) "
                       "at which affinity of held-out text is recorded")
        r.add_argument("--lr", type=real(0, 10, strict=True), default=3e-3, help="AdamW learning rate")
        r.add_argument("--max-bytes", type=count(1, 1 << 34), default=6_000_000, help="bytes of the stdlib source read (head "
                       "in sorted path order; the last 1%% + trace tokens are held out)")
        r.add_argument("--out", required=True, help="directory: hpdl_moe.pt, history.json, affinity.png")
        b = sub.add_parser("bench", formatter_class=F, help="tokens/s ExFlow vs 2-Alltoall baseline (gloo ranks)")
        from hpdl.moe.bench import MoEBenchCommand

        MoEBenchCommand.add_arguments(b)

    def run(self, args) -> int:
        fn = {"trace": _trace, "affinity": _affinity, "place": _place, "train": _train, "bench": _bench}
        if args.moe_cmd not in fn:
            raise CLIUsageError("choose a sub-command: trace, affinity, place, train or bench")
        return fn[args.moe_cmd](args)


def _trace(args) -> int:
    import numpy as np

    from hpdl.models.gpt_moe import load_model
    from hpdl.moe.errors import MoEError
    from hpdl.moe.trace import collect_trace

    model = load_model(args.model)
    tok_file = Path(args.model) / "tokenizer.json"
    if tok_file.is_file():
        from tokenizers import Tokenizer

        text = Path(args.text).read_text() if args.text else _text_ids(None, 4 * args.tokens)[0].tobytes().decode(
            "utf-8", "replace")
        ids, source = np.array(Tokenizer.from_file(str(tok_file)).encode(text).ids), f"tokenized:{args.text or 'stdlib'}"
    else:
        if model.cfg.vocab_size < 256:
            raise MoEError(f"--model has vocab_size={model.cfg.vocab_size} < 256 and no tokenizer.json")
        ids, source = _text_ids(args.text, args.tokens + args.seq)
    if args.seq < 1 or args.tokens < 1:
        raise MoEError(f"--tokens and --seq must be >= 1, got --tokens={args.tokens} --seq={args.seq}")
    if args.seq > model.cfg.max_position:
        raise MoEError(f"--seq={args.seq} exceeds the model's max_position={model.cfg.max_position}")
    n = min(len(ids), args.tokens) // args.seq
    if n == 0:
        raise MoEError(f"--tokens={args.tokens} and the text give no full window of --seq={args.seq}")
    tr = collect_trace(model, ids[: n * args.seq].reshape(n, args.seq).astype(np.int64), source=source)
    path = tr.save(args.out)
    print(f"{tr.experts.shape[0]} tokens x {tr.experts.shape[1]} MoE layers x top-{tr.experts.shape[2]} -> {path}")
    return 0


def _affinity(args) -> int:
    from hpdl.moe import affinity
    from hpdl.moe.trace import Trace

    tr = Trace.load(args.trace)
    s = affinity.summary(tr.experts, tr.n_experts)
    print(f"{s['n_tokens']} tokens, {s['n_experts']} experts (uniform 1/E = {s['uniform']:.3f})")
    print(f"{'transition':>10} {'mean max P':>11} {'shuffled':>9} {'MI bits':>8} {'shuffled':>9}")
    for i in range(len(s["mean_max_conditional"])):
        print(f"{i:>4} -> {i + 1:<3} {s['mean_max_conditional'][i]:11.3f} {s['shuffled_mean_max_conditional'][i]:9.3f} "
              f"{s['mutual_information_bits'][i]:8.3f} {s['shuffled_mutual_information_bits'][i]:9.3f}")
    m = s["mean"]
    print(f"{'mean':>10} {m['mean_max_conditional']:11.3f} {m['shuffled_mean_max_conditional']:9.3f} "
          f"{m['mutual_information_bits']:8.3f} {m['shuffled_mutual_information_bits']:9.3f}")
    if args.plot:
        affinity.plot_heatmaps(affinity.transition_counts(tr.experts, tr.n_experts), args.plot,
                               title=f"{tr.meta.get('model', {}).get('arch', '')} {tr.meta.get('data', {}).get('source', '')[:60]}")
        print(f"heat maps -> {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1))
    return 0


def _place(args) -> int:
    from hpdl.moe import affinity, placement
    from hpdl.moe.trace import Trace

    tr = Trace.load(args.trace)
    fit, test = tr.split(args.train_fraction)
    if len(fit.experts) == 0 or len(test.experts) == 0:
        from hpdl.moe.errors import MoEError

        raise MoEError(f"trace {args.trace} has {len(tr.experts)} tokens: --train-fraction={args.train_fraction} "
                       f"leaves no token to fit or to evaluate on")
    E = tr.n_experts
    C_fit, C_test = affinity.transition_counts(fit.experts, E), affinity.transition_counts(test.experts, E)
    res = placement.place(C_fit, args.world_size, method=args.method, ranks_per_node=args.ranks_per_node,
                          time_limit=args.time_limit)
    ev = placement.evaluate(C_test, res.ranks, args.world_size)
    ev["busiest_rank_share"] = placement.load_share(C_test, res.ranks)["max_share"]
    if args.ranks_per_node:
        ev["placement_cross_node"] = placement.cross_share(C_test, res.ranks, args.ranks_per_node)
    res.save(args.out, model=tr.meta.get("model"), data=tr.meta.get("data"), heldout=ev,
             moe_layers=tr.meta.get("moe_layers"))
    print(f"{res.method} ({res.status}, {res.seconds:.1f}s): held-out cross-GPU share {ev['placement']:.3f} vs "
          f"contiguous {ev['contiguous']:.3f}, random {ev['random_mean']:.3f} (= {ev['ratio_vs_random']:.2f}x random); "
          f"busiest rank holds {ev['busiest_rank_share']:.2f} of a layer's tokens (ideal {1 / args.world_size:.2f})")
    print(f"placement -> {args.out}")
    return 0


def _train(args) -> int:
    from hpdl.models.gpt_moe import MoEConfig
    from hpdl.moe.train import plot_history, train
    from hpdl.runtime.limits import check_fits

    if args.hidden % 8:   # 4 heads of an even head_dim (rotary embedding rotates pairs)
        raise CLIUsageError(f"--hidden must be a multiple of 8 (4 attention heads, each of an even size), got "
                            f"{args.hidden}")
    if args.top_k > args.experts:
        raise CLIUsageError(f"--top-k must be <= --experts={args.experts}, got {args.top_k}")
    # weights + AdamW's two moments + gradients (fp32), the experts' SwiGLU dominating; activations of a batch
    h = args.hidden
    params = args.layers * (4 * h * h + args.experts * 3 * h * 2 * h) + 2 * 256 * h
    acts = args.batch * args.seq * h * args.layers * 16
    check_fits(4 * (4 * params + acts), "--hidden/--experts/--layers/--batch/--seq",
               what=f"a {params / 1e6:.0f}M-parameter MoE trained at batch {args.batch} x {args.seq}")
    cfg = MoEConfig(vocab_size=256, hidden_size=args.hidden, n_layers=args.layers, n_heads=4, n_kv_heads=4,
                    n_experts=args.experts, top_k=args.top_k, expert_size=2 * args.hidden,
                    max_position=max(256, args.seq))
    _, hist = train(cfg, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, checkpoints=args.checkpoints,
                    max_bytes=args.max_bytes, out_dir=args.out, progress=lambda s: print(s, flush=True))
    plot_history(hist, Path(args.out) / "affinity.png")
    print(f"model, history.json, affinity.png -> {args.out}")
    return 0


def _bench(args) -> int:
    from hpdl.moe.bench import MoEBenchCommand

    return MoEBenchCommand().run(args)
