"""Device-resident engine pieces on CPU: the device dispatch planner, grouped expert GEMMs, local-only expert
weights, K/V gathered in the cache dtype, capacity overflow reported, and a decode step that reads no device value
on the host (a TorchFunctionMode that refuses every host read stands in for CUDA's sync-debug mode)."""
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hpdl.models.gpt_moe import MoEConfig, MoEDecoder
from hpdl.moe import dispatch, grouped
from hpdl.moe.errors import MoEError
from hpdl.testing import get_pool

CFG = dict(vocab_size=61, hidden_size=32, n_layers=4, n_heads=4, n_kv_heads=2, n_experts=8, top_k=1,
           expert_size=24, moe_every=1)


def make_model(cfg_kw, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = MoEDecoder(MoEConfig(**cfg_kw)).eval()
    with torch.no_grad():
        for blk in m.layers:
            if blk.is_moe:
                blk.mlp.gate.weight.normal_(0, 0.5)
    return m.to(dtype)


# --- host-read guard ---------------------------------------------------------------------------------------
_HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique", "numpy",
               "masked_select", "bincount", "cpu"}


class HostSyncError(AssertionError):
    pass


class NoHostReads(TorchFunctionMode):
    """Raise on any tensor operation that moves a device value to the host (what would be a CUDA sync): item,
    tolist, bool/int of a tensor, nonzero/unique, boolean-mask indexing. hpdl.comm's own code is exempt (on CPU
    gloo reads its buffers; on CUDA the peer kernel does not)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        bad = name in _HOST_READS
        if name == "__getitem__" and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            bad = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        if name == "to" and any(str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values())):
            bad = True
        if bad and not any("hpdl/comm" in f.filename for f in traceback.extract_stack()):
            raise HostSyncError(f"host read {name} in a decode step")
        return func(*args, **kwargs)


def test_guard_catches_host_reads():
    x = torch.arange(4)
    for fn in (lambda: x.sum().item(), lambda: x.tolist(), lambda: bool(x.sum()), lambda: x[x > 1],
               lambda: torch.bincount(x)):
        with pytest.raises(HostSyncError), NoHostReads():
            fn()
    with NoHostReads():
        (x.cumsum(0) + 1)[torch.tensor([0, 2])]  # device-only work passes


def _guarded_engine(**kw):
    import hpdl.moe.engine as E

    class Guarded(E.MoEEngine):
        def _forward(self, *a, **k):
            if self._phase == 1:  # decode forwards only (prefill may read the prompt table)
                with NoHostReads():
                    return super()._forward(*a, **k)
            return super()._forward(*a, **k)

        def _record_tokens(self, *a, **k):
            if self._phase == 1:
                with NoHostReads():
                    return super()._record_tokens(*a, **k)
            return super()._record_tokens(*a, **k)

    return Guarded(**kw)


@pytest.mark.parametrize("mode,kw", [("baseline", dict(CFG, top_k=2, shared_expert_size=16, arch="qwen2_moe")),
                                     ("exflow", CFG)])
def test_decode_step_reads_nothing_on_the_host(mode, kw):
    m = make_model(kw)
    prompts = [[1, 2, 3], [4, 5], [7]]
    eng = _guarded_engine(model=m, mode=mode, capacity="worst_case", device="cpu")
    out = eng.generate(prompts, 5)
    assert out == {i: m.greedy(p, 5) for i, p in enumerate(prompts)}
    # the exact-count mode syncs by design: the guard must see it (so the check above can fail)
    with pytest.raises(HostSyncError):
        _guarded_engine(model=m, mode=mode, capacity="exchange", device="cpu").generate(prompts, 3)


# --- planner ------------------------------------------------------------------------------------------------
def test_device_plan_matches_host_plan_and_counts_overflow():
    g = torch.Generator().manual_seed(0)
    dest = torch.randint(0, 4, (50,), generator=g)
    valid = torch.ones(50, dtype=torch.bool)
    p = dispatch.plan_device(dest, valid, 4)
    ref = dispatch.plan(dest, 4)
    assert p.counts.tolist() == ref.send_counts and int(p.overflow) == 0
    assert torch.equal(torch.sort(p.spos).indices, ref.order)  # exact mode = the stable host grouping
    valid[::3] = False  # pads: not counted, sent to the trash row
    p = dispatch.plan_device(dest, valid, 4)
    assert p.counts.tolist() == torch.bincount(dest[valid], minlength=4).tolist()
    assert (p.spos[~valid] == p.trash).all() and len(set(p.spos[valid].tolist())) == int(valid.sum())
    C = 3
    p = dispatch.plan_device(dest, valid, 4, C)
    over = (p.counts - C).clamp_min(0).sum()
    assert int(p.overflow) == int(over) > 0 and p.trash == 4 * C
    kept = p.spos[p.spos < p.trash]
    assert len(kept) == int(valid.sum()) - int(over) and len(set(kept.tolist())) == len(kept)
    assert ((kept // C) == dest[p.spos < p.trash]).all()  # each row in its destination's block


def test_capacity_overflow_is_reported_not_silent(monkeypatch):
    import hpdl.moe.engine as E

    real = E.MoEEngine._dispatch  # a capacity below the worst case (the engine never picks one)
    monkeypatch.setattr(E.MoEEngine, "_dispatch", lambda self, r, d, v, li, C: real(self, r, d, v, li, max(1, C // 4)))
    with pytest.raises(MoEError, match="exceeded the agreed capacity"):
        E.MoEEngine(make_model(CFG), mode="baseline", capacity="worst_case").generate([[1, 2, 3, 4, 5, 6]], 2)


# --- grouped GEMM -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_swiglu_backends_equal_the_per_expert_loop(dtype):
    g = torch.Generator().manual_seed(1)
    H, Fd, El, M = 32, 24, 3, 11
    x = torch.randn(M, H, generator=g).to(dtype)
    wgu = (torch.randn(El, 2 * Fd, H, generator=g) * 0.2).to(dtype)
    wd = (torch.randn(El, H, Fd, generator=g) * 0.2).to(dtype)
    ends = [4, 4, 9]  # an empty group; rows 9, 10 are pads
    offs = torch.tensor(ends, dtype=torch.int32)
    ref, start = [], 0
    for e, end in enumerate(ends):
        gate, up = torch.nn.functional.linear(x[start:end], wgu[e]).chunk(2, -1)
        ref.append(torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, wd[e]))
        start = end
    ref = torch.cat(ref)
    for backend in ("bmm", "grouped_mm") if hasattr(torch, "_grouped_mm") else ("bmm",):
        y = grouped.swiglu(x, wgu, wd, offs, backend)[:9]
        tol = dict(atol=0, rtol=0) if backend == "grouped_mm" and dtype == torch.float32 else dict(atol=2e-2,
                                                                                                     rtol=2e-2)
        torch.testing.assert_close(y, ref, **tol)
    assert grouped.backend_for(torch.device("cpu"), torch.float32, (32, 24, 48)) in ("grouped_mm", "bmm")
    assert grouped.backend_for(torch.device("cpu"), torch.float32, (30, 24, 48)) == "bmm"  # 120 B rows: unaligned
    with pytest.raises(MoEError, match="grouped backend"):
        grouped.backend_for(torch.device("cpu"), torch.float32, (32,), "cutlass")


# --- multi-rank: local experts only, K/V in the cache dtype -------------------------------------------------
def _local_and_dtypes(ctx, dtype_name):
    import hpdl.moe.engine as E
    from hpdl.moe.placement import random_placement

    dtype = getattr(torch, dtype_name)
    m = make_model(CFG, dtype=dtype)
    seen = []

    class Rec(E.MoEEngine):
        def _gather(self, rows, what, async_op=False):
            seen.append((what, rows.dtype))
            return super()._gather(rows, what, async_op)

    place = random_placement(4, 8, ctx.world_size, seed=3)
    eng = Rec(m, place, mode="exflow", capacity="worst_case", check=False)
    prompts = [[[1, 2, 3], [9]], [[4, 5, 6, 7]]][ctx.rank]
    out = eng.generate(prompts, 4)
    local = [tuple(w.shape) for w in eng.w_gate_up]
    shell = sum(blk.mlp.w_gate_up.numel() + blk.mlp.w_down.numel() for blk in eng.net.layers if blk.is_moe)
    mine = [sorted((place[li] == ctx.rank).nonzero()[0].tolist()) for li in range(4)]
    ok = all(torch.equal(eng.w_gate_up[li], m.layers[li].mlp.w_gate_up.detach()[mine[li]]) for li in range(4))
    return out, local, shell, ok, sorted(set((w, str(d)) for w, d in seen))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_only_local_experts_and_kv_gathered_in_cache_dtype(dtype):
    res = get_pool(2).run(_local_and_dtypes, dtype, timeout=120)
    m = make_model(CFG, dtype=getattr(torch, dtype))
    ref = {i: m.greedy(p, 4) for i, p in enumerate([[1, 2, 3], [9], [4, 5, 6, 7]])}
    got = {}
    for out, local, shell, ok, seen in res:
        got.update(out)
        assert local == [(4, 48, 32)] * 4 and shell == 0 and ok  # E/G experts per layer, no full copy
        assert ("K/V all-gather", f"torch.{dtype}") in seen, seen
    assert got == ref


# --- device "meta": no data at all, so any host read or CPU tensor mixed into the device path raises -----------
@pytest.mark.parametrize("mode,kw", [("baseline", dict(CFG, top_k=2, shared_expert_size=16, arch="qwen2_moe")),
                                     ("exflow", CFG)])
def test_whole_generate_runs_on_a_device_without_data(mode, kw):
    """Stands in for FakeTensor on "cuda": on device "meta" every tensor op is shape-only, so a tensor left on the
    CPU (a device mix) or a value read on the host fails; only the one final read (``_host``) is allowed."""
    import hpdl.moe.engine as E

    reads = []

    class Meta(E.MoEEngine):
        def _host(self, t):
            assert t.device.type == "meta"
            reads.append(tuple(t.shape))
            return torch.zeros(t.shape, dtype=t.dtype).tolist()

    m = make_model(kw)
    out = Meta(m, mode=mode, device="meta", capacity="worst_case").generate([[1, 2, 3], [4, 5]], 4)
    assert sorted(out) == [0, 1] and len(reads) == 2  # the tokens and the row counters, after the loop
    with pytest.raises(NotImplementedError, match="meta"):  # exact counts are read on the host: caught
        Meta(m, mode=mode, device="meta", capacity="exchange").generate([[1, 2, 3], [4, 5]], 4)
