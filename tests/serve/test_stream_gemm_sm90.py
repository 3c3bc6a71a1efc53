"""hpdl.serve.stream_gemm compiled for sm_90 on the CPU (Triton ships ptxas; no GPU needed): the shared-memory
bound that filters configs holds for what Triton really allocates, and the PDL variant carries its
grid-dependency instructions."""

from __future__ import annotations

import pytest

from hpdl.serve import stream_gemm as sg



def _compile_sm90(cfg: dict, dt: str, epi: int, norm: bool, pdl: bool = False):
    """``triton.compile`` of the kernel for sm_90 (no GPU needed: Triton ships ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: f"*{dt}" for n in ("x_ptr", "w_ptr", "out_ptr", "res_ptr", "nw_ptr")}
    sig.update(part_ptr="*fp32", cnt_ptr="*i32", eps="fp32",
               **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_rm", "SPLIT_K")})
    const = dict(EPI=epi, NORM=norm, DOT=cfg["BLOCK_M"] > 1, PREC="ieee" if dt == "fp32" else "tf32",
                 UPCAST=False, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], EVEN=True,
                 NORM_K=sg.norm_chunk(2048, cfg["BLOCK_M"]), PDL=pdl)
    sig.update({k: "constexpr" for k in const})
    # the launcher specialises pointers and the i32 arguments N, K and the strides as multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i in (*range(7), 8, 9, 10, 11, 12, 13)}
    src = ASTSource(sg._stream_gemm_kernel, sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))


def test_shared_memory_bound_holds_for_sm90_compiles():
    """The estimate bounds what Triton really allocates (the failing H200 config included), and the PDL variant
    compiles with its grid-dependency instructions."""
    pytest.importorskip("triton")
    cases = [(dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3), "bf16", 2, False),
             (dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4), "bf16", 1, False),
             (dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, num_warps=8, num_stages=1), "bf16", 2, True)]
    try:
        compiled = [_compile_sm90(c, dt, epi, norm) for c, dt, epi, norm in cases]
    except Exception as exc:  # noqa: BLE001 - an install without the CUDA backend's tools
        pytest.skip(f"cannot compile for sm_90 here: {exc!r}"[:200])
    # the 64-row SiLU-mul config the H200 run (17:30) could not launch: 262144 B of 232448; the old bound said
    # 135168, so the config was kept; the bound now covers it and fit_shared_memory shrinks it
    assert compiled[0].metadata.shared == 262144
    fit = sg.fit_shared_memory(cases[0][0], 2, 2, False, sg.SHARED_MEMORY_H200)
    assert fit is not None and fit["num_stages"] < 3
    for (c, dt, epi, norm), k in zip(cases, compiled):
        assert k.metadata.shared <= sg.shared_memory_bytes(c, 4 if dt == "fp32" else 2, epi, norm), (c, dt)
    import re

    # the GEMV's weight loads are 16-byte vector loads
    assert len(re.findall(r"ld\.global[^\n]*\.v4", compiled[2].asm["ptx"])) >= 4
    ptx = _compile_sm90(cases[2][0], "bf16", 2, True, pdl=True).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert "griddepcontrol" not in compiled[2].asm["ptx"]


def test_rope_kv_pdl_variant_compiles_for_sm90():
    """With ``stream_gemm.PDL`` the fused step launches rope_kv with PDL too: it waits first, then releases."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hpdl.serve import fused as fz

    sig = dict(qkv_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64", q_ptr="*bf16", kc_ptr="*bf16",
               vc_ptr="*bf16", start="i32", s_slot="i32", s_head="i32", s_pos="i32", H="i32", HKV="i32",
               D="constexpr", PDL="constexpr")
    try:
        k = triton.compile(ASTSource(fz._rope_kv_kernel, sig, constexprs=dict(D=64, PDL=True)),
                           target=GPUTarget("cuda", 90, 32))
    except Exception as exc:  # noqa: BLE001 - an install without the CUDA backend's tools
        pytest.skip(f"cannot compile for sm_90 here: {exc!r}"[:200])
    ptx = k.asm["ptx"]
    assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
