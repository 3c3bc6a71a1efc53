"""``hpdl moe {trace,affinity,place,train,bench}``: thin wrappers that parse, call hpdl.moe and print.

The flags of trace, affinity and place are generated from :mod:`hpdl.moe.study`'s options dataclasses, those of
train from :class:`hpdl.moe.train.TrainOptions`; bench is the harness plug-in :mod:`hpdl.moe.bench`."""

from __future__ import annotations

import argparse

from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.options import add_arguments, from_namespace


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
        from hpdl.moe.study import AffinityOptions, PlaceOptions, TraceOptions
        from hpdl.moe.train import TrainOptions

        sub = parser.add_subparsers(dest="moe_cmd", metavar="{trace,affinity,place,train,bench}")
        for name, cls, text in (
                ("trace", TraceOptions, "record every token's experts per MoE layer (npz)"),
                ("affinity", AffinityOptions, "affinity statistics vs shuffled baseline, heat maps"),
                ("place", PlaceOptions, "ILP expert placement; held-out cross-GPU share"),
                ("train", TrainOptions, "train a tiny MoE on stdlib source; affinity per checkpoint")):
            add_arguments(sub.add_parser(name, formatter_class=_Help, help=text), cls)
        b = sub.add_parser("bench", formatter_class=_Help, help="tokens/s ExFlow vs 2-Alltoall baseline (gloo ranks)")
        from hpdl.moe.bench import MoEBenchCommand

        MoEBenchCommand.add_arguments(b)

    def run(self, args) -> int:
        fn = {"trace": _trace, "affinity": _affinity, "place": _place, "train": _train, "bench": _bench}
        if args.moe_cmd not in fn:
            raise CLIUsageError("choose a sub-command: trace, affinity, place, train or bench")
        return fn[args.moe_cmd](args)


def _trace(args) -> int:
    from hpdl.moe.study import TraceOptions, trace

    tr, path = trace(from_namespace(TraceOptions, args))
    print(f"{tr.experts.shape[0]} tokens x {tr.experts.shape[1]} MoE layers x top-{tr.experts.shape[2]} -> {path}")
    return 0


def _affinity(args) -> int:
    from hpdl.moe.study import AffinityOptions, affinity

    o = from_namespace(AffinityOptions, args)
    s = affinity(o)
    print(f"{s['n_tokens']} tokens, {s['n_experts']} experts (uniform 1/E = {s['uniform']:.3f})")
    print(f"{'transition':>10} {'mean max P':>11} {'shuffled':>9} {'MI bits':>8} {'shuffled':>9}")
    for i in range(len(s["mean_max_conditional"])):
        print(f"{i:>4} -> {i + 1:<3} {s['mean_max_conditional'][i]:11.3f} {s['shuffled_mean_max_conditional'][i]:9.3f} "
              f"{s['mutual_information_bits'][i]:8.3f} {s['shuffled_mutual_information_bits'][i]:9.3f}")
    m = s["mean"]
    print(f"{'mean':>10} {m['mean_max_conditional']:11.3f} {m['shuffled_mean_max_conditional']:9.3f} "
          f"{m['mutual_information_bits']:8.3f} {m['shuffled_mutual_information_bits']:9.3f}")
    if o.plot:
        print(f"heat maps -> {o.plot}")
    return 0


def _place(args) -> int:
    from hpdl.moe.study import PlaceOptions, place

    o = from_namespace(PlaceOptions, args)
    res, ev = place(o)
    print(f"{res.method} ({res.status}, {res.seconds:.1f}s): held-out cross-GPU share {ev['placement']:.3f} vs "
          f"contiguous {ev['contiguous']:.3f}, random {ev['random_mean']:.3f} (= {ev['ratio_vs_random']:.2f}x random); "
          f"busiest rank holds {ev['busiest_rank_share']:.2f} of a layer's tokens (ideal {1 / o.world_size:.2f})")
    print(f"placement -> {o.out}")
    return 0


def _train(args) -> int:
    from hpdl.moe.train import TrainOptions, train

    o = from_namespace(TrainOptions, args)
    train(o, progress=lambda s: print(s, flush=True))
    print(f"model, history.json, affinity.png -> {o.out}")
    return 0


def _bench(args) -> int:
    from hpdl.moe.bench import MoEBenchCommand

    return MoEBenchCommand().run(args)
