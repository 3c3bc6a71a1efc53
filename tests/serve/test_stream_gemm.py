"""hpdl.serve.stream_gemm: argument checks in-process; the Triton kernel on CPU under TRITON_INTERPRET=1 (in a
subprocess: the interpreter is chosen when kernels are defined) against its torch reference, over several M, N, K
(non-multiples of the blocks), every epilogue, the GEMV and tl.dot paths, and split-K with its in-kernel reduction."""

from __future__ import annotations

import itertools

import pytest
import torch

from serve_testutil import run_interpreted
from hpdl.serve import stream_gemm as sg


def test_bad_arguments_name_the_argument():
    x, w = torch.randn(2, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="2-D"):
        sg.stream_gemm(x[0], w)
    with pytest.raises(ValueError, match=r"w must be \[N, 8\]"):
        sg.stream_gemm(x, torch.randn(6, 7))
    with pytest.raises(ValueError, match="dtype"):
        sg.stream_gemm(x, w.double())
    with pytest.raises(ValueError, match="2N rows"):
        sg.stream_gemm(x, torch.randn(5, 8), silu_mul=True)
    with pytest.raises(ValueError, match="cannot be combined"):
        sg.stream_gemm(x, w, residual=torch.randn(2, 3), silu_mul=True)
    with pytest.raises(ValueError, match=r"residual must be \[2, 6\]"):
        sg.stream_gemm(x, w, residual=torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"norm_weight must be \[8\]"):
        sg.stream_gemm(x, w, norm_weight=torch.ones(7))


def test_reference_is_the_eager_op_sequence():
    torch.manual_seed(0)
    x, w, r, nw = torch.randn(3, 16), torch.randn(10, 16), torch.randn(3, 5), torch.rand(16)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw
    y = h @ w.T
    want = torch.nn.functional.silu(y[:, :5]) * y[:, 5:]
    torch.testing.assert_close(sg.stream_gemm_ref(x, w, None, nw, 1e-5, silu_mul=True), want)
    torch.testing.assert_close(sg.stream_gemm_ref(x, w[:5], r), x @ w[:5].T + r)


def test_buckets_and_split_counts():
    assert [sg.m_bucket(m) for m in (1, 2, 16, 17, 64, 65, 129, 1000)] == [1, 16, 16, 32, 64, 128, 256, 256]
    # 1.1B shapes on 132 SMs: o_proj at M = 1 (64 tiles of 32 columns) splits K 4 ways (one 512-wide step each)
    assert sg.split_k(1, 2048, 2048, 1, 32, 512, 132) == 4
    # 5 wanted, 22 steps of 256: the nearest divisor of 22 (11) so every split is whole steps (no weight masks)
    assert sg.split_k(1, 2048, 5632, 1, 32, 256, 132) == 11
    assert sg.is_even(2048, 5632, dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=11))
    assert sg.split_k(1, 2048, 5632, 1, 32, 256, 132, per_sm=0) == 1  # the no-split configs
    assert sg.split_k(1, 2048, 200, 1, 32, 32, 132) == 5  # K not a multiple of BLOCK_K: the count as wanted
    # a launch never has an empty split: 33 columns in 4 splits of one 16-wide step is 3 splits
    assert sg.launch_split(33, 16, 4) == 3 and sg.launch_split(2048, 256, 8) == 8
    assert sg.split_k(256, 32000, 2048, 128, 64, 64, 132) == 1  # enough tiles: no split
    for m in (1, 16, 64, 256):
        for c in sg.candidates(m, 2560, 2048, 132):
            assert c["SPLIT_K"] >= 1 and c["BLOCK_M"] <= max(16, sg.m_bucket(m))


def test_candidates_fit_shared_memory():
    # the H200 run: float32 16-row SiLU-mul configs with the prologue asked for 265216 B of 232448
    bad = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4)
    assert sg.shared_memory_bytes(bad, 4, epi=2, norm=True) > sg.SHARED_MEMORY_H200
    fit = sg.fit_shared_memory(bad, 4, 2, True, sg.SHARED_MEMORY_H200)
    assert fit["num_stages"] < 4 and sg.shared_memory_bytes(fit, 4, 2, True) <= sg.SHARED_MEMORY_H200
    assert sg.fit_shared_memory(bad, 2, 2, True, sg.SHARED_MEMORY_H200) == bad  # bf16 fits as it is
    assert sg.fit_shared_memory(bad, 4, 2, True, 1000) is None
    for m, isz, epi, norm in itertools.product((1, 16, 32, 64, 128, 256), (2, 4), (0, 1, 2), (False, True)):
        cands = sg.candidates(m, 11264 if epi == 2 else 2560, 2048, 132, isz, epi, norm, sg.SHARED_MEMORY_H200)
        assert cands and all(sg.shared_memory_bytes(c, isz, epi, norm) <= sg.SHARED_MEMORY_H200 for c in cands)
        assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
    # the 1.1B decode shapes at M = 1: most configs do not split, and all of them need no weight masks
    for n, k in ((2560, 2048), (2048, 2048), (5632, 2048), (2048, 5632), (32000, 2048)):
        cands = sg.candidates(1, n, k, 132)
        assert sum(c["SPLIT_K"] == 1 for c in cands) >= len(cands) // 2
        assert all(sg.is_even(n, k, c) for c in cands), (n, k, [c for c in cands if not sg.is_even(n, k, c)])
    with pytest.raises(ValueError, match="no config fits"):
        sg.candidates(16, 2560, 2048, 132, 4, 2, True, smem_limit=1000)


def test_triton_kernel_interpreted_matches_reference():
    run_interpreted(__file__)


def _interpreted_check() -> None:
    assert sg._use_triton(torch.zeros(1)), "TRITON_INTERPRET=1 must be set before hpdl.serve.stream_gemm is imported"
    torch.manual_seed(0)
    cases = [(1, 40, 96), (3, 33, 200), (17, 70, 130)]  # N, K not multiples of the 16 x 32 blocks below
    cases += [(1, 32, 128), (5, 32, 128)]  # multiples: the unmasked (EVEN) weight loads
    for dt, (M, N, K) in [(torch.float32, c) for c in cases] + [(torch.bfloat16, c) for c in cases[1:4]]:
        tol = dict(rtol=1e-5, atol=1e-5) if dt == torch.float32 else dict(rtol=0.02, atol=0.05)
        for silu, res, norm in itertools.product((False, True), repeat=3):
            if silu and res:
                continue
            x = torch.randn(M, K, dtype=dt)
            w = (torch.randn(2 * N if silu else N, K) * 0.1).to(dt)
            r = torch.randn(M, N, dtype=dt) if res else None
            nw = torch.rand(K, dtype=dt) if norm else None
            ref = sg.stream_gemm_ref(x, w, r, nw, 1e-5, silu)
            even = N % 16 == 0 and K % 64 == 0
            for bm, sk, bk in itertools.product((1, 16), (1, 2, 3), (32, 128)):
                if (bm == 1 and M > 1) or sk == (3 if even else 2) or (bk == 128 and (not even or bm == 16)):
                    continue  # bk = 128: a program's whole K range in one step (the one-shot GEMV configs)
                cfg = dict(BLOCK_M=bm, BLOCK_N=16, BLOCK_K=bk, num_warps=4, num_stages=2, SPLIT_K=sk)
                got = sg.stream_gemm(x, w, r, nw, 1e-5, silu, config=cfg)
                torch.testing.assert_close(got, ref, **tol, msg=lambda m: f"{dt} {M}x{N}x{K} silu={silu} "
                                           f"res={res} norm={norm} {cfg}: {m}")
                if sk > 1 and silu:  # the split-K partials reduce in split order: bitwise the same on a re-run
                    assert torch.equal(sg.stream_gemm(x, w, r, nw, 1e-5, silu, config=cfg), got)
            if dt == torch.float32:  # the cuBLAS candidate: F.linear between the fused step's own kernels
                got = sg.stream_gemm(x, w, r, nw, 1e-5, silu, config=sg.CUBLAS_CONFIG)
                torch.testing.assert_close(got, ref, **tol)
                if not norm and not silu:  # no Triton RMSNorm / SiLU kernel: exactly the eager ops
                    assert torch.equal(got, ref), (M, N, K, silu, res)
    assert int(sg.counters(torch.device("cpu")).abs().sum()) == 0, "split-K counters must be left at 0"
    x, w = torch.randn(5, 64), torch.randn(48, 64)  # the default candidate (no config) runs too
    torch.testing.assert_close(sg.stream_gemm(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    # 33 columns asked in 4 splits of 16: the 4th split would be empty (the GEMV's last step read columns of the
    # 3rd one again before launch_split); the launch runs 3
    x, w = torch.randn(1, 33), torch.randn(16, 33)
    cfg = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1, SPLIT_K=4)
    torch.testing.assert_close(sg.stream_gemm(x, w, config=cfg), x @ w.T, rtol=1e-5, atol=1e-5)
    print("ok")


if __name__ == "__main__":
    _interpreted_check()
