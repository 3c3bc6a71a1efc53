"""The GPT workload's attention under a fused model's vmap (hpdl.hpo.fusion.scaled_dot_product_attention).

On CUDA, float32 SDPA takes the memory-efficient kernel; called inside vmap the query hid ``requires_grad``,
the kernel skipped the log-sum-exp and its backward failed ("LSE is not correctly aligned (strideH)", H200,
2026-12-04). CPU runs other kernels, so these tests check what the CUDA kernel depends on: SDPA is called on
plain tensors that require grad, the trial dimension folded into the batch dimension, each sample laid out
as its trial alone lays it out."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

from hpdl.hpo import fusion
from hpdl.hpo.fusion import FusedModel, scaled_dot_product_attention
from hpdl.hpo.workloads import get_workload

GPT = {"n_embd": 32, "n_layer": 2, "n_head": 2, "block_size": 16, "batch_size": 4}


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every call of torch's SDPA: whether a tensor was a vmap tensor, required grad, its shape and strides."""
    calls, real = [], F.scaled_dot_product_attention

    def record(q, k, v, *args, **kw):
        calls.append([(torch._C._functorch.is_batchedtensor(t), t.requires_grad, tuple(t.shape), t.stride())
                      for t in (q, k, v)])
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    return calls


def _models(k):
    w = get_workload("gpt")
    out = []
    for seed in range(k):
        torch.manual_seed(seed)
        out.append(w.build(w.resolve({**GPT, "seed": seed}), torch.device("cpu")))
    return w, out


def test_fused_gpt_calls_sdpa_once_per_layer_on_folded_tensors_that_require_grad(sdpa_calls):
    k = 3
    w, parts = _models(k)
    x, y = parts[0].batch(0)
    parts[0].loss(parts[0].model(x), y).backward()
    alone = list(sdpa_calls)
    sdpa_calls.clear()
    fused = FusedModel([p.model for p in parts])
    losses = fused.losses(parts[0].loss, x, y, shared=True)
    assert len(sdpa_calls) == len(alone) == GPT["n_layer"]  # one call per layer, not one per trial
    b, h, t, hs = GPT["batch_size"], GPT["n_head"], GPT["block_size"], GPT["n_embd"] // GPT["n_head"]
    for (qa, _, _), call in zip(alone, sdpa_calls):
        for batched, grad, shape, stride in call:
            assert not batched and grad  # what the efficient kernel needs to keep its log-sum-exp
            assert shape == (k * b, h, t, hs)
            assert stride[1:] == qa[3][1:]  # each sample as its trial alone lays it out (a view, no copy)
    losses.sum().backward()
    for n, p in fused.params.items():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


def test_fused_gpt_gradients_equal_each_trial_alone():
    k = 3
    w, parts = _models(k)
    fused = FusedModel([p.model for p in parts])
    x, y = parts[0].batch(0)
    fused.losses(parts[0].loss, x, y, shared=True).sum().backward()
    for i, p in enumerate(parts):
        p.loss(p.model(x), y).backward()
        for n, q in p.model.named_parameters():
            torch.testing.assert_close(fused.params[n].grad[i], q.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (0, None, 1), (None, 2, 0)])
@pytest.mark.parametrize("rank", [2, 3, 4])
def test_folded_attention_matches_torch_under_vmap_and_alone(in_dims, rank):
    torch.manual_seed(0)
    k, shape = 3, (2, 2, 5, 4)[4 - rank:]

    def make(d):
        s = list(shape)
        if d is not None:
            s.insert(d, k)
        return torch.randn(*s, dtype=torch.float64, requires_grad=True)

    qkv = [make(d) for d in in_dims]

    def ref_one(i):  # trial i's inputs, alone
        return [t if d is None else t.select(d, i) for t, d in zip(qkv, in_dims)]

    out = vmap(lambda q, kk, v: scaled_dot_product_attention(q, kk, v, is_causal=True), in_dims=in_dims)(*qkv)
    grads = torch.autograd.grad(out.square().sum(), qkv)
    want = torch.stack([F.scaled_dot_product_attention(*ref_one(i), is_causal=True) for i in range(k)])
    want_grads = torch.autograd.grad(want.square().sum(), qkv)
    torch.testing.assert_close(out, want)
    for g, wg in zip(grads, want_grads):
        torch.testing.assert_close(g, wg)
    # alone (no vmap) it is torch's function; the Function's own backward (recompute) agrees with torch's
    plain = [t.detach().select(d, 0).clone().requires_grad_(True) if d is not None else t for t, d in
             zip(qkv, in_dims)]
    a = scaled_dot_product_attention(*plain, scale=0.3)
    b = fusion._FoldedAttention.apply(*plain, False, 0.3)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(torch.autograd.grad(a.sum(), plain), torch.autograd.grad(b.sum(), plain))


@pytest.mark.parametrize("kv_shape", [(2, 5, 4), (1, 2, 5, 4), (5, 4)])
def test_folded_attention_broadcasts_batch_dims_like_torch(kv_shape):
    # SDPA broadcasts key/value batch dims against the query's; the fold put K into different dims of each
    torch.manual_seed(0)
    k = 3
    q = torch.randn(k, 2, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    kk = torch.randn(k, *kv_shape, dtype=torch.float64, requires_grad=True)
    v = torch.randn(k, *kv_shape, dtype=torch.float64, requires_grad=True)
    out = vmap(lambda a, b, c: scaled_dot_product_attention(a, b, c, is_causal=True))(q, kk, v)
    want = torch.stack([F.scaled_dot_product_attention(q[i], kk[i], v[i], is_causal=True) for i in range(k)])
    torch.testing.assert_close(out, want)
    for g, wg in zip(torch.autograd.grad(out.square().sum(), (q, kk, v)),
                     torch.autograd.grad(want.square().sum(), (q, kk, v))):
        torch.testing.assert_close(g, wg)
