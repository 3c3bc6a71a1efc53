"""hpdl.offload.cecopy on CPU: the C struct's layout and the call's arguments for both runtime signatures
(CUDA 12.8-12.9 with failIdx, 13.x without), against a stand-in runtime that records the call."""

import ctypes

import pytest

from hpdl.offload import cecopy
from hpdl.offload.errors import OffloadError


def test_attributes_match_the_c_struct():
    # driver_types.h: enum srcAccessOrder; cudaMemLocation srcLocHint {enum type; int id}; dstLocHint; uint flags
    A = cecopy.MemcpyAttributes
    assert ctypes.sizeof(A) == 24
    assert [getattr(A, f).offset for f in ("srcAccessOrder", "srcLocHint_type", "srcLocHint_id",
                                           "dstLocHint_type", "dstLocHint_id", "flags")] == [0, 4, 8, 12, 16, 20]


class _Runtime:
    """Stands in for libcudart: records cudaMemcpyBatchAsync's arguments, returns ``rc``."""

    def __init__(self, rc=0):
        self.calls, self.rc = [], rc
        outer = self

        class Fn:
            restype = None

            def __call__(self, *args):
                outer.calls.append(args)
                return outer.rc

        self.cudaMemcpyBatchAsync = Fn()
        self.cudaGetErrorString = lambda rc: b"invalid argument"


@pytest.mark.parametrize("version,nargs", [(13000, 8), (12080, 9)])
def test_call_has_the_signature_of_the_runtime(version, nargs):
    rt = _Runtime()
    b = cecopy.BatchCopy([0x1000, 0x2000], [0x3000, 0x4000], [64, 128], lib=rt, version=version)
    b.issue(0xABC)
    (args,) = rt.calls
    assert len(args) == nargs
    dsts, srcs, sizes, count, attrs, idx, nattrs = args[:7]
    assert list(dsts) == [0x1000, 0x2000] and list(srcs) == [0x3000, 0x4000] and list(sizes) == [64, 128]
    assert count.value == 2 and nattrs.value == 1 and list(idx) == [0]
    a = attrs._obj
    assert a.srcAccessOrder == cecopy.SRC_ACCESS_ORDER_STREAM and a.flags == cecopy.FLAG_PREFER_OVERLAP_WITH_COMPUTE
    assert args[-1].value == 0xABC


def test_errors_are_named():
    rt = _Runtime(rc=1)
    b = cecopy.BatchCopy([1], [2], [8], lib=rt, version=13000)
    with pytest.raises(OffloadError, match="error 1 invalid argument"):
        b.issue(5)
    with pytest.raises(OffloadError, match="legacy default stream"):
        b.issue(0)
    with pytest.raises(OffloadError, match="as many dsts"):
        cecopy.BatchCopy([1, 2], [2], [8], lib=rt, version=13000)
    with pytest.raises(OffloadError, match="> 0 bytes"):
        cecopy.BatchCopy([1], [2], [0], lib=rt, version=13000)
    b = cecopy.BatchCopy([1], [2], [8], lib=rt, version=13000, prefer_copy_engine=False)
    assert b._attrs.flags == 0


def _bad_copy_mode(ctx):
    import os

    import torch

    import hpdl.offload as ho
    from hpdl.offload.errors import PlanError

    os.environ["HPDL_OFFLOAD_CUDA_COPY"] = "dma" if ctx.rank == 0 else "kernel"  # one rank's typo
    x = torch.zeros(2, 4)
    try:
        ho.alltoall_init(x, torch.zeros(2, 4), progress="graph", timeout=30)
    except PlanError as exc:
        return str(exc)
    return "no error"


def test_bad_copy_mode_is_an_error_on_every_rank():
    from hpdl.runtime import spawn

    for msg in spawn(_bad_copy_mode, 2, timeout=120):
        assert "HPDL_OFFLOAD_CUDA_COPY must be one of ('kernel', 'ce'), got 'dma'" in msg and "rank 0" in msg, msg


def test_cpu_copies_ignore_the_cuda_copy_mode(monkeypatch):
    import torch

    from hpdl.offload.executor import _copy_fn

    for mode in ("ce", "bogus"):  # only copies between buffers of one GPU read it
        monkeypatch.setenv("HPDL_OFFLOAD_CUDA_COPY", mode)
        dst, src = torch.zeros(2, 3), torch.arange(6.0)
        fn = _copy_fn(dst, src)
        fn()
        assert fn.pair is not None and dst.view(-1).tolist() == src.tolist()


def test_a_library_without_the_runtime_api_is_a_reason_not_a_crash(monkeypatch):
    # whatever libcudart.so path is found (here: libc, which has no cudaRuntimeGetVersion) must end as the
    # reason why copy-engine copies are unavailable; before, ctypes' AttributeError escaped runtime()
    import ctypes.util

    from hpdl.offload import cecopy

    libc = ctypes.util.find_library("c")
    monkeypatch.setattr(cecopy, "_LIB", [])
    monkeypatch.setattr(cecopy, "_loaded_cudart", lambda: libc)
    lib, version, reason = cecopy.runtime()
    assert lib is None and version == 0 and "cudaRuntimeGetVersion" in reason, reason
