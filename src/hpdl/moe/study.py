"""The affinity study's steps after training, each a library entry point taking its options dataclass (``hpdl moe
trace/affinity/place`` generate their flags from these; ``hpdl moe train`` is :func:`hpdl.moe.train.train`):

    from hpdl.moe.study import PlaceOptions, TraceOptions, place, trace
    trace(TraceOptions(model="runs/moe", out="runs/moe/t.npz"))
    result, heldout = place(PlaceOptions(trace="runs/moe/t.npz", world_size=4, out="place.json"))

ExFlow (arXiv 2401.08383): trace which experts every token takes (:func:`trace`), measure inter-layer affinity
(:func:`affinity`), and place experts so that routing stays on one GPU (:func:`place`), fitted on the head of the
trace and evaluated on the held-out rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpdl.moe import affinity as _affinity
from hpdl.moe import placement
from hpdl.moe.errors import MoEError
from hpdl.moe.trace import Trace, collect_trace
from hpdl.moe.train import stdlib_corpus
from hpdl.runtime.limits import count, real
from hpdl.runtime.options import Options, option


@dataclass(kw_only=True)
class TraceOptions(Options):
    """:func:`trace`: record every token's experts per MoE layer."""

    model: str = option(help="hpdl checkpoint dir (hpdl moe train --out) or a local HF Mixtral/Qwen2-MoE/OLMoE dir "
                        "(byte-level text needs vocab >= 256, else its tokenizer)")
    text: str | None = option(None, help="text file (default: the tail of the Python stdlib source, files "
                              "`hpdl moe train` does not read)")
    tokens: int = option(16384, type=count(1), help="tokens to trace (rounded down to whole windows)")
    seq: int = option(128, type=count(1, 1 << 16), help="window length in tokens")
    out: str = option(help="output .npz")


@dataclass(kw_only=True)
class AffinityOptions(Options):
    """:func:`affinity`: affinity statistics of a trace against its shuffled-token baseline."""

    trace: str = option(help=".npz from `hpdl moe trace`", positional=True)
    plot: str | None = option(None, help="PNG of P(expert at l+1 | expert at l) per transition")
    json: str | None = option(None, help="write the summary here")


PLACE_METHODS = ("auto", "ilp", "bisect", "two_stage", "greedy", "contiguous", "random")


@dataclass(kw_only=True)
class PlaceOptions(Options):
    """:func:`place`: ILP expert placement fitted on the head of a trace, evaluated on the rest."""

    trace: str = option(help=".npz from `hpdl moe trace`", positional=True)
    world_size: int = option(type=count(1, 4096), help="expert-parallel ranks (GPUs) G; must divide the trace's "
                             "expert count")
    ranks_per_node: int | None = option(None, type=count(1, 4096), help="ranks per node; adds the inter-node hop "
                                        "cost (2x an intra-node hop); default: one node")
    method: str = option("auto", choices=PLACE_METHODS, help="auto = two_stage with --ranks-per-node < G, else "
                         "bisect for power-of-two G >= 4, else ilp (docs/moe.md, Placement)")
    time_limit: float | None = option(None, type=real(0, 86400, strict=True), help="seconds for HiGHS, shared by "
                                      "bisection (default HPDL_MOE_ILP_TIME_LIMIT, 60)")
    train_fraction: float = option(0.5, type=real(0, 1, strict=True), help="fit on this head of the trace, report "
                                   "on the rest")
    out: str | None = option(None, required=True, help="placement JSON for MoEEngine")   # None: not written


def text_ids(path: str | None, max_bytes: int) -> tuple[np.ndarray, str]:
    """Bytes of the text file ``path`` (at most ``max_bytes``), or of the stdlib's tail (held out from
    :func:`hpdl.moe.train.train`, which reads the head), as ``(uint8 array, source description)``."""
    if path:
        b = Path(path).read_bytes()[:max_bytes]
        return np.frombuffer(b, dtype=np.uint8).copy(), f"file:{path}"
    return stdlib_corpus(max_bytes, part="tail")


def trace(options: TraceOptions) -> tuple[Trace, Path]:
    """Trace ``options.tokens`` tokens of text through the model in windows of ``options.seq``; the model's
    ``tokenizer.json`` tokenizes the text when the directory has one, else the text is bytes.

    Returns ``(trace, path written)``.

    Raises:
        MoEError: a byte-level model with ``vocab_size < 256``, ``seq`` beyond the model's ``max_position``, or
            text shorter than one window.
    """
    from hpdl.models.gpt_moe import load_model

    o = options
    model = load_model(o.model)
    tok_file = Path(o.model) / "tokenizer.json"
    if tok_file.is_file():
        from tokenizers import Tokenizer

        text = Path(o.text).read_text() if o.text else text_ids(None, 4 * o.tokens)[0].tobytes().decode(
            "utf-8", "replace")
        ids, source = np.array(Tokenizer.from_file(str(tok_file)).encode(text).ids), f"tokenized:{o.text or 'stdlib'}"
    else:
        if model.cfg.vocab_size < 256:
            raise MoEError(f"--model has vocab_size={model.cfg.vocab_size} < 256 and no tokenizer.json")
        ids, source = text_ids(o.text, o.tokens + o.seq)
    if o.seq < 1 or o.tokens < 1:
        raise MoEError(f"--tokens and --seq must be >= 1, got --tokens={o.tokens} --seq={o.seq}")
    if model.position_limit is not None and o.seq > model.position_limit:
        raise MoEError(f"--seq={o.seq} exceeds the model's max_position={model.cfg.max_position}")
    n = min(len(ids), o.tokens) // o.seq
    if n == 0:
        raise MoEError(f"--tokens={o.tokens} and the text give no full window of --seq={o.seq}")
    tr = collect_trace(model, ids[: n * o.seq].reshape(n, o.seq).astype(np.int64), source=source)
    return tr, tr.save(o.out)


def affinity(options: AffinityOptions) -> dict:
    """:func:`hpdl.moe.affinity.summary` of the trace; heat maps to ``options.plot`` and the summary as JSON to
    ``options.json`` when given.

    Raises:
        MoEError: not an hpdl trace, or an empty one.
    """
    tr = Trace.load(options.trace)
    s = _affinity.summary(tr.experts, tr.n_experts)
    if options.plot:
        _affinity.plot_heatmaps(_affinity.transition_counts(tr.experts, tr.n_experts), options.plot,
                                title=f"{tr.meta.get('model', {}).get('arch', '')} "
                                      f"{tr.meta.get('data', {}).get('source', '')[:60]}")
    if options.json:
        Path(options.json).write_text(json.dumps(s, indent=1))
    return s


def place(options: PlaceOptions) -> tuple[placement.PlacementResult, dict]:
    """Fit a placement on the first ``train_fraction`` of the trace; evaluate it on the rest.

    Returns ``(result, heldout)``: heldout is :func:`hpdl.moe.placement.evaluate` of the held-out tokens with
    ``busiest_rank_share`` (and ``placement_cross_node`` with ``ranks_per_node``). With ``options.out`` the
    placement JSON is written there.

    Raises:
        MoEError: a trace whose split leaves no token to fit or evaluate on; PlacementError from the solver.
    """
    o = options
    tr = Trace.load(o.trace)
    fit, test = tr.split(o.train_fraction)
    if len(fit.experts) == 0 or len(test.experts) == 0:
        raise MoEError(f"trace {o.trace} has {len(tr.experts)} tokens: --train-fraction={o.train_fraction} "
                       f"leaves no token to fit or to evaluate on")
    E = tr.n_experts
    C_fit, C_test = _affinity.transition_counts(fit.experts, E), _affinity.transition_counts(test.experts, E)
    res = placement.place(C_fit, o.world_size, method=o.method, ranks_per_node=o.ranks_per_node,
                          time_limit=o.time_limit)
    ev = placement.evaluate(C_test, res.ranks, o.world_size)
    ev["busiest_rank_share"] = placement.load_share(C_test, res.ranks)["max_share"]
    if o.ranks_per_node:
        ev["placement_cross_node"] = placement.cross_share(C_test, res.ranks, o.ranks_per_node)
    if o.out is not None:
        res.save(o.out, model=tr.meta.get("model"), data=tr.meta.get("data"), heldout=ev,
                 moe_layers=tr.meta.get("moe_layers"))
    return res, ev
