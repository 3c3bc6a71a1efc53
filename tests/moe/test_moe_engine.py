"""Expert-parallel engine (gloo ranks from hpdl.testing.get_pool): baseline and ExFlow give the single-process
greedy tokens for world sizes 1, 2, 4, with uneven and empty ranks, any placement, and no padding rows."""
import numpy as np
import pytest
import torch

from hpdl.models.gpt_moe import MoEConfig, MoEDecoder
from hpdl.moe import dispatch
from hpdl.moe.errors import MoEError
from hpdl.moe.placement import random_placement
from hpdl.testing import get_pool

CFG = dict(vocab_size=61, hidden_size=32, n_layers=4, n_heads=4, n_kv_heads=2, n_experts=8, top_k=1,
           expert_size=24, moe_every=1)


def make_model(cfg_kw, seed=0):
    torch.manual_seed(seed)
    m = MoEDecoder(MoEConfig(**cfg_kw)).eval()
    with torch.no_grad():  # sharper routers, so experts on every rank get used
        for blk in m.layers:
            if blk.is_moe:
                blk.mlp.gate.weight.normal_(0, 0.5)
    return m


def prompts_for(world, per_rank, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, CFG["vocab_size"], rng.integers(2, 9)).tolist() for _ in range(n)]
            for n in per_rank[:world]]


def _run(ctx, cfg_kw, mode, placement, prompts, max_new, record, capacity="exchange"):
    import hpdl.moe.engine as E

    m = make_model(cfg_kw)
    eng = E.MoEEngine(m, placement, mode=mode, record_routing=record, capacity=capacity)
    out = eng.generate(prompts[ctx.rank], max_new)
    return out, eng.stats.as_dict(), {f"{k[0]},{k[1]}": v for k, v in eng.routing.items()}


def reference(cfg_kw, prompts, max_new):
    m = make_model(cfg_kw)
    flat = [p for rank in prompts for p in rank]
    return {i: m.greedy(p, max_new) for i, p in enumerate(flat)}


@pytest.mark.parametrize("world", [1, 4, 2])  # world 2 last: the next tests reuse its pool
def test_tokens_identical_to_single_process(world):
    prompts = prompts_for(world, [3, 1, 0, 2])  # uneven loads; rank 2 has no request at all
    ref = reference(CFG, prompts, 6)
    pool = get_pool(world)
    place = random_placement(4, 8, world, seed=world)
    for mode, capacity in (("baseline", "exchange"), ("exflow", "exchange"), ("baseline", "worst_case"),
                           ("exflow", "worst_case")):
        res = pool.run(_run, CFG, mode, place, prompts, 6, False, capacity)
        got = {}
        for out, _, _ in res:
            got.update(out)
        assert got == ref, (mode, capacity)
        st = res[0][1]
        n_moe = 4
        if world > 1:  # one payload Alltoall per MoE layer per forward in ExFlow's decode, two in the baseline
            calls = st["a2a_calls"]
            steps = 6  # 1 prefill + 5 decode forwards
            want = 2 * steps if mode == "baseline" else 2 + (steps - 1)
            assert all(calls[li] == want for li in range(n_moe)), (mode, calls)
            # count exchanges only with exact capacities; padded ones need none
            assert st["count_calls"] == (0 if capacity == "worst_case" else sum(calls.values()) // (
                2 if mode == "baseline" else 1) - (n_moe if mode == "exflow" else 0)), (mode, capacity, st)


def test_top2_baseline_and_shared_expert():
    kw = dict(CFG, top_k=2, shared_expert_size=16, arch="qwen2_moe", moe_every=2)
    prompts = prompts_for(2, [2, 2], seed=3)
    ref = reference(kw, prompts, 4)
    res = get_pool(2).run(_run, kw, "baseline", None, prompts, 4, False)
    got = {}
    for out, _, _ in res:
        got.update(out)
    assert got == ref
    with pytest.raises(MoEError, match="top_k"):
        import hpdl.moe.engine as E

        E.MoEEngine(make_model(kw), mode="exflow")


def test_padding_free_rows_and_token_order_vs_padded_reference():
    """Dispatched rows = real tokens (no pad copies), and each (request, position) routes exactly as the
    padded single-process batch does, whatever order the packed engine processed the tokens in."""
    prompts = prompts_for(2, [2, 3], seed=5)
    res = get_pool(2).run(_run, CFG, "exflow", None, prompts, 3, True)
    flat = [p for r in prompts for p in r]
    n_real = sum(len(p) for p in flat)
    rows0 = sum(r[1]["rows_dispatched"].get(0, 0) for r in res)
    assert rows0 == n_real + 2 * len(flat)  # prefill tokens + 2 decode forwards, one row each, no padding
    routing = {}
    for r in res:
        routing.update(r[2])
    m = make_model(CFG)
    T = max(len(p) for p in flat)
    ids = torch.zeros(len(flat), T, dtype=torch.long)
    am = torch.zeros(len(flat), T)
    for i, p in enumerate(flat):
        ids[i, :len(p)] = torch.tensor(p)
        am[i, :len(p)] = 1
    with torch.no_grad():
        _, _, experts = m(ids, am, return_routing=True)
    for i, p in enumerate(flat):
        for q in range(len(p)):
            want = [int(e[i * T + q, 0]) for e in experts]
            assert [x[0] for x in routing[f"{i},{q}"]] == want, (i, q)


def test_dispatch_plan_is_stable_and_capacity_needs_agreement():
    dest = torch.tensor([1, 0, 1, 2, 0, 1])
    p = dispatch.plan(dest, 3)
    assert p.order.tolist() == [1, 4, 0, 2, 5, 3] and p.send_counts == [2, 3, 1]
    x = torch.arange(6)
    assert torch.equal(x[p.order][dispatch.inverse(p.order)], x)
    # locally computed capacities disagree when ranks hold different token counts (the hang/mis-size pitfall)
    assert dispatch.local_capacity(3, 1, 8) != dispatch.local_capacity(40, 1, 8)
    with pytest.raises(MoEError, match="world_size=3"):
        dispatch.plan(torch.tensor([3]), 3)


def test_engine_rejects_foreign_placement():
    import hpdl.moe.engine as E
    from hpdl.moe.errors import PlacementError

    with pytest.raises(MoEError, match="placement shape"):
        E.MoEEngine(make_model(CFG), np.zeros((3, 8), dtype=int), mode="baseline")
    with pytest.raises(PlacementError):
        E.MoEEngine(make_model(CFG), np.zeros((4, 8), dtype=int) + 1, mode="baseline")


def _local_capacity_alltoall(ctx):
    """Each rank sizes its receive buffer from a capacity computed from its own token count (the pitfall)."""
    import hpdl.comm as hc
    from hpdl.runtime.errors import CollectiveMismatchError

    n_local = 4 if ctx.rank == 0 else 40
    G = ctx.world_size
    send = [n_local // G] * G
    cap = dispatch.local_capacity(n_local, 1, 8)
    recv = [send[q] if q == ctx.rank else cap for q in range(G)]
    try:
        hc.all_to_all_single(torch.zeros(sum(recv), 4), torch.ones(sum(send), 4), output_split_sizes=recv,
                             input_split_sizes=send, check=True)
    except CollectiveMismatchError as e:
        return str(e)
    return "no error"


def test_disagreeing_capacities_are_caught_not_hung():
    msgs = get_pool(2).run(_local_capacity_alltoall, timeout=60)
    assert all("split" in m.lower() for m in msgs), msgs


def _disagree(ctx, case):
    """Rank 1 alone passes something bad or different; every rank must raise the same MoEError, not block."""
    import hpdl.moe.engine as E

    m = make_model(CFG)
    odd = ctx.rank == 1
    place = random_placement(4, 8, 2, seed=1 if odd and case == "placement" else 0)
    if odd and case == "world_size":  # a placement file written for 4 ranks: rank 1 alone would raise in __init__
        place = random_placement(4, 8, 4, seed=0)
    mode = "baseline" if odd and case == "mode" else "exflow"
    prompts = [[]] if odd and case == "empty" else [[61, 3]] if odd and case == "vocab" else [[1, 2, 3]]
    if odd and case == "flat":
        prompts = [1, 2, 3]
    if odd and case == "huge":
        prompts = [[1, 2 ** 70]]
    if odd and case == "float":
        prompts = [[1, 2.0]]
    new = 4 if odd and case == "new_tokens" else 0 if odd and case == "zero" else 3
    check = True if odd and case == "check" else False
    eng = E.MoEEngine(m, place, mode=mode, check=check)
    try:
        eng.generate(prompts, new)
    except MoEError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case,words", [("new_tokens", "max_new_tokens=4"), ("empty", "empty"),
                                        ("zero", "max_new_tokens must be"), ("vocab", "vocab_size"),
                                        ("placement", "placement"), ("mode", "mode=baseline"),
                                        ("flat", "prompts must be a list of prompts"), ("huge", "vocab_size"),
                                        ("float", "int token ids"), ("world_size", "placement"),
                                        ("check", "check=True")])
def test_ranks_that_disagree_all_raise_naming_the_rank(case, words):
    import time

    t0 = time.monotonic()
    msgs = get_pool(2).run(_disagree, case, timeout=60)
    assert time.monotonic() - t0 < 20, "a rank waited for a collective timeout instead of failing fast"
    assert msgs[0] == msgs[1] and "rank 1" in msgs[0] and words in msgs[0], msgs


def _bf16_run(ctx, mode):
    import hpdl.moe.engine as E

    torch.manual_seed(0)
    m = MoEDecoder(MoEConfig(vocab_size=61, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=2, n_experts=4,
                             expert_size=16, max_position=400)).eval().to(torch.bfloat16)
    long = torch.randint(0, 61, (301,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = [[long], [[5, 6]]][ctx.rank] if ctx.world_size == 2 else [long, [5, 6]]
    eng = E.MoEEngine(m, mode=mode, record_routing=True)
    out = eng.generate(prompts, 4)
    return out, {k: v for k, v in eng.routing.items()}, [m.greedy(p, 4) for p in prompts]


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_model_positions_above_256(world):
    """A bf16 model (how HF checkpoints ship): the KV cache takes the model's dtype, and request ids, positions
    and gate weights ride the Alltoall bit-exactly (a bf16 cast turns position 301 into 300 or 302)."""
    class Ctx:
        rank, world_size = 0, 1

    for mode in ("baseline", "exflow"):
        res = get_pool(2).run(_bf16_run, mode) if world == 2 else [_bf16_run(Ctx, mode)]
        got, routing, ref = {}, {}, []
        for out, rt, rf in res:
            got.update(out)
            for key, v in rt.items():  # in ExFlow a token's layers are recorded on the ranks it visited
                routing[key] = [a if a is not None else b for a, b in zip(routing.get(key, v), v)]
            ref += rf
        assert got == dict(enumerate(ref)), mode
        want = {(0, q) for q in range(304)} | {(1, q) for q in range(5)}  # prompt + 3 decode forwards
        assert set(routing) == want and all(None not in v for v in routing.values()), mode


def _one_rank_dies(ctx, path):
    import os
    import time

    import hpdl.moe.engine as E

    os.environ["HPDL_TIMEOUT"] = "5"
    eng = E.MoEEngine(make_model(CFG), mode="exflow")
    if ctx.rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        eng.generate([[1, 2, 3]], 8)
        msg = "no error"
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        msg = f"{type(e).__name__}: {e}"
    with open(path, "w") as f:
        f.write(f"{time.monotonic() - t0:.1f}\n{msg}")
    return msg


def test_killed_rank_raises_a_typed_error_not_a_hang(tmp_path):
    """Rank 1 dies; rank 0 must get an hpdl error naming itself and the collective within HPDL_TIMEOUT (5 s)."""
    from hpdl.runtime.errors import WorkerFailedError

    f = tmp_path / "rank0.txt"
    pool = get_pool(2)
    try:
        with pytest.raises(WorkerFailedError, match="rank 1 died"):
            pool.run(_one_rank_dies, str(f), timeout=60)
    finally:
        # the pool counts a dead rank as answered and stays "healthy"; retire it so later tests get live ranks
        pool.close()
    for _ in range(50):  # rank 0 writes its outcome before the pool tears it down
        if f.exists() and f.read_text().count("\n"):
            break
        import time

        time.sleep(0.1)
    secs, msg = f.read_text().split("\n", 1)
    # hpdl.comm's PeerFailedError (a CollectiveTimeoutError) names the dead rank; the engine's own
    # WorkerFailedError (for a backend error hpdl.comm did not type) names this rank and the collective
    assert float(secs) < 6 and msg.split(":")[0] in ("PeerFailedError", "WorkerFailedError",
                                                     "CollectiveTimeoutError"), msg
    assert "[1]" in msg or "rank 0:" in msg, msg
