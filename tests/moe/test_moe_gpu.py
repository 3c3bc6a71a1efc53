"""GPU checks of hpdl.moe (``pytest -m gpu``; skipped without CUDA): the device engine on one GPU is
token-identical to the single-process reference, a decode step makes no host sync (CUDA sync-debug "error"), a
CUDA-graph replayed decode equals eager, and G = 2, 4, 8 ranks sharing the one GPU (hpdl.testing's
``ranks_per_gpu`` launch mode: every rank on cuda:0, a gloo group, hpdl.comm's peer transport for CUDA tensors)
give the G = 1 tokens."""

import numpy as np
import pytest
import torch

from hpdl.models.gpt_moe import MoEConfig, MoEDecoder
from hpdl.moe import dispatch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CFG = dict(vocab_size=61, hidden_size=64, n_layers=4, n_heads=4, n_kv_heads=2, n_experts=8, top_k=1,
           expert_size=32, moe_every=1)
TOP2 = dict(CFG, top_k=2, shared_expert_size=32, arch="qwen2_moe")


def make_model(cfg_kw, seed=0):
    torch.manual_seed(seed)
    m = MoEDecoder(MoEConfig(**cfg_kw)).eval()
    with torch.no_grad():
        for blk in m.layers:
            if blk.is_moe:
                blk.mlp.gate.weight.normal_(0, 0.5)
    return m


def prompts_for(world, per_rank, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, CFG["vocab_size"], rng.integers(2, 9)).tolist() for _ in range(n)]
            for n in per_rank[:world]]


def test_plan_and_inverse_stay_on_the_device():
    # inverse() once built its arange on the host: a device mismatch on the first CUDA layer timing
    dest = torch.randint(0, 4, (1000,), device="cuda")
    p = dispatch.plan(dest, 4)
    x = torch.randn(1000, 8, device="cuda")
    inv = dispatch.inverse(p.order)
    assert inv.device == x.device and torch.equal(x[p.order][inv], x)
    pd = dispatch.plan_device(dest, torch.ones(1000, dtype=torch.bool, device="cuda"), 4)
    assert pd.spos.device == dest.device and torch.equal(torch.sort(pd.spos).indices, p.order)


@pytest.mark.parametrize("mode,kw", [("baseline", TOP2), ("exflow", CFG)])
def test_one_gpu_tokens_identical_to_reference(mode, kw):
    from hpdl.moe.engine import MoEEngine

    m = make_model(kw)
    prompts = prompts_for(4, [3, 1, 0, 2])
    flat = [p for r in prompts for p in r]
    ref = {i: m.greedy(p, 6) for i, p in enumerate(flat)}  # CPU fp32 reference
    for capacity in ("worst_case", "exchange"):
        eng = MoEEngine(m, mode=mode, device="cuda", capacity=capacity)
        assert eng.w_gate_up[0].is_cuda and eng.grouped_backend == "bmm"  # fp32 on CUDA: the sync-free path
        assert eng.generate(flat, 6) == ref, capacity
        assert eng.cache.k.is_cuda


class _SyncDebugEngine:
    """Wraps decode forwards in ``torch.cuda.set_sync_debug_mode("error")``: any host sync raises."""

    @staticmethod
    def make(**kw):
        from hpdl.moe.engine import MoEEngine

        class E(MoEEngine):
            def _forward(self, *a, **k):
                if self._phase != 1:
                    return super()._forward(*a, **k)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return super()._forward(*a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode("default")

            def _record_tokens(self, *a, **k):
                if self._phase != 1:
                    return super()._record_tokens(*a, **k)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return super()._record_tokens(*a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        return E(**kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,kw", [("baseline", TOP2), ("exflow", CFG)])
def test_decode_step_has_no_host_sync(mode, kw, dtype):
    m = make_model(kw).to(dtype)
    eng = _SyncDebugEngine.make(model=m, mode=mode, device="cuda", capacity="worst_case")
    prompts = [[1, 2, 3], [4, 5], [7]]
    out = eng.generate(prompts, 5)  # raises RuntimeError on a sync inside a decode forward
    if dtype == torch.float32:
        assert out == {i: m.greedy(p, 5) for i, p in enumerate(prompts)}
    else:  # bf16 on SM90+: torch._grouped_mm's kernel, which reads its offsets on the device
        sm90 = torch.cuda.get_device_capability() >= (9, 0)
        assert eng.grouped_backend == ("grouped_mm" if sm90 and hasattr(torch, "_grouped_mm") else "bmm")
        assert sorted(out) == [0, 1, 2] and all(len(v) == 5 for v in out.values())


@pytest.mark.parametrize("mode,kw", [("baseline", TOP2), ("exflow", CFG)])
def test_cuda_graph_replay_equals_eager(mode, kw):
    from hpdl.moe.engine import MoEEngine

    m = make_model(kw)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    eager = MoEEngine(m, mode=mode, device="cuda", capacity="worst_case")
    want = eager.generate(prompts, 8)
    g = MoEEngine(m, mode=mode, device="cuda", capacity="worst_case")
    assert g.generate(prompts, 8, cuda_graph=True) == want
    assert g.graph is not None
    assert want == {i: m.greedy(p, 8) for i, p in enumerate(prompts)}


def _shared_gpu_run(ctx, cfg_kw, mode, placement, prompts, max_new, capacity):
    from hpdl.moe.engine import MoEEngine

    m = make_model(cfg_kw)
    eng = MoEEngine(m, placement, mode=mode, device="cuda", capacity=capacity, check=False)
    assert eng.algorithm == "push" or ctx.world_size == 1
    return eng.generate(prompts[ctx.rank], max_new), [tuple(w.shape) for w in eng.w_gate_up]


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("mode,kw", [("baseline", TOP2), ("exflow", CFG)])
def test_ranks_sharing_one_gpu_equal_one_rank(world, mode, kw):
    from hpdl.moe.engine import MoEEngine
    from hpdl.moe.placement import random_placement
    from hpdl.testing.pool import get_pool

    prompts = prompts_for(world, [3, 1, 0, 2, 1, 2, 1, 3])
    flat = [p for r in prompts for p in r]
    one = MoEEngine(make_model(kw), mode=mode, device="cuda", capacity="worst_case").generate(flat, 6)
    place = random_placement(len(MoEConfig(**kw).moe_layers), 8, world, seed=world)
    pool = get_pool(world, device="cuda", ranks_per_gpu=world)
    for capacity in ("worst_case", "exchange"):
        res = pool.run(_shared_gpu_run, kw, mode, place, prompts, 6, capacity, timeout=300)
        got = {}
        for out, shapes in res:
            got.update(out)
            assert all(s[0] == 8 // world for s in shapes)
        assert got == one, (world, mode, capacity)
