"""progress='graph' on CPU: the byte ranges of every copy a rank's CUDA graph would capture (plan_pulls) are
computed from the buffers' layouts (views with storage offsets, as torch's caching allocator and IPC handles
give them), checked inside their storage, and equal what torch's own view arithmetic gives."""

import inspect

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

import hpdl.offload as ho
from hpdl.offload import plans
from hpdl.offload.compiler import compile_group
from hpdl.offload.errors import OffloadError
from hpdl.offload.graph import BufferLayout, plan_pulls


def _in_storage(t: torch.Tensor, offset: int) -> torch.Tensor:
    """``t``'s values placed ``offset`` elements into a larger storage (a view with a storage offset)."""
    base = torch.full((offset + t.numel() + 7,), -1.0, dtype=t.dtype)
    v = base[offset:offset + t.numel()].view(t.shape)
    v.copy_(t)
    return v


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as uint8 (what a raw device pointer from an IPC handle addresses)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def test_extent_of_a_view_with_a_storage_offset_matches_torch():
    u = _in_storage(torch.zeros(4, 6, 6), 37)
    lay = BufferLayout.of_tensor(u)
    assert lay == BufferLayout((4, 6, 6), (36, 6, 1), 37, 4, (37 + 144 + 7) * 4, 0)
    for box in [((0, 4), (0, 6), (0, 6)), ((1, 2), (1, 5), (1, 5)), ((3, 4), (0, 6), (5, 6)), ((2, 2), (0, 6), (0, 6))]:
        v = u[tuple(slice(a, b) for a, b in box)]
        off, span = lay.extent(box)
        if v.numel():  # (torch gives an empty view data_ptr 0)
            assert off == v.data_ptr() - u.untyped_storage().data_ptr(), box
            assert span == (sum((n - 1) * s for n, s in zip(v.shape, v.stride())) + 1) * 4
        else:
            assert span == 0 and off == v.storage_offset() * 4
    assert lay.extent(((1, 2), (1, 5), (1, 5))) == ((37 + 36 + 6 + 1) * 4, (3 * 6 + 3 + 1) * 4)


def test_of_ipc_reads_torchs_rebuild_arguments_by_name():
    names = list(inspect.signature(rebuild_cuda_tensor).parameters)
    vals = {"tensor_size": torch.Size([2, 8]), "tensor_stride": (8, 1), "tensor_offset": 24,
            "dtype": torch.float64, "storage_size_bytes": 1024, "storage_offset_bytes": 2048}
    args = tuple(vals.get(n) for n in names)
    assert BufferLayout.of_ipc(rebuild_cuda_tensor, args) == BufferLayout((2, 8), (8, 1), 24, 8, 1024, 2048)
    def other(x):  # a rebuild function without torch's argument names
        return x

    with pytest.raises(OffloadError, match="cannot read a CUDA IPC handle made by 'other'"):
        BufferLayout.of_ipc(other, (1,))


def _alltoall(P, count):
    return compile_group([plans.alltoall(r, P, count, "float32").data() for r in range(P)], key=1)


def test_alltoall_pulls_from_peers_with_storage_offsets_are_exact():
    """Every rank's buffers sit at a different storage offset; the planned byte ranges, replayed as raw byte
    copies between the storages (what the graph's cudaMemcpyAsync nodes do), give the exact Alltoall."""
    P, count = 3, 5
    comp = _alltoall(P, count)
    send, recv = "input", "output"
    bufs = {q: {send: _in_storage(torch.arange(P * count, dtype=torch.float32).view(P, count) + 100 * q, 3 + 11 * q),
                recv: _in_storage(torch.zeros(P, count), 5 * q)} for q in range(P)}
    for s in comp[0].buffers:
        assert bufs[0][s.name].shape == s.shape
    layouts = {q: {n: BufferLayout.of_tensor(t) for n, t in bufs[q].items()} for q in range(P)}
    for r in range(P):
        pulls = plan_pulls(comp, r, layouts)
        assert sorted(p.src_rank for p in pulls) == list(range(P))
        for p in pulls:
            assert p.nbytes == p.src_span == p.dst_span == count * 4  # rows: contiguous, one memcpy each
            assert p.src_off == (3 + 11 * p.src_rank + r * count) * 4
            assert p.dst_off == (5 * r + p.src_rank * count) * 4
            _bytes(bufs[r][p.dst_buffer])[p.dst_off:p.dst_off + p.nbytes] = \
                _bytes(bufs[p.src_rank][p.src_buffer])[p.src_off:p.src_off + p.nbytes]
    for r in range(P):
        want = torch.stack([torch.arange(r * count, (r + 1) * count, dtype=torch.float32) + 100 * q
                            for q in range(P)])
        assert torch.equal(bufs[r][recv], want)
        whole = _bytes(bufs[r][recv])  # the bytes around the view are untouched
        assert torch.equal(whole[:5 * r * 4], _bytes(torch.full((5 * r,), -1.0)))
        assert torch.equal(whole[(5 * r + P * count) * 4:], _bytes(torch.full((7,), -1.0)))


def test_halo_pulls_are_strided_boxes_inside_their_storage():
    """A 3-D halo exchange: faces are strided boxes; each planned range equals torch's view of the box and
    lies inside the storage (the offset of the view included)."""
    P = 2
    comp = compile_group([plans.halo3d((2, 4, 4), (P, 1, 1), r, torch.float32).data() for r in range(P)], key=1)
    bufs = {q: {"u": _in_storage(torch.zeros(4, 6, 6), 13 * (q + 1))} for q in range(P)}
    layouts = {q: {"u": BufferLayout.of_tensor(bufs[q]["u"])} for q in range(P)}
    for r in range(P):
        pulls = plan_pulls(comp, r, layouts)
        assert pulls
        for p in pulls:
            for who, box, off, span in ((p.src_rank, p.src_box, p.src_off, p.src_span),
                                        (r, p.dst_box, p.dst_off, p.dst_span)):
                t = bufs[who]["u"]
                v = t[tuple(slice(a, b) for a, b in box)]
                assert off == v.data_ptr() - t.untyped_storage().data_ptr()
                assert 0 <= off and off + span <= t.untyped_storage().nbytes()
                assert p.nbytes == v.numel() * 4 <= span


def test_a_box_beyond_the_peer_storage_is_refused_before_capture():
    """A handle whose storage is smaller than the buffer it claims (a wrong offset or size): PlanError naming
    the rank, the operation, the byte range and the storage's size, before any address enters a graph."""
    P, count = 2, 4
    comp = _alltoall(P, count)
    layouts = {q: {b.name: BufferLayout(b.shape, (count, 1), 0, 4, P * count * 4) for b in comp[q].buffers}
               for q in range(P)}
    assert len(plan_pulls(comp, 0, layouts)) == P  # in range: fine
    # rank 1's input 5 elements into a storage of 8: its row 0 (what rank 0 pulls) is bytes [20, 36)
    layouts[1]["input"] = BufferLayout((P, count), (count, 1), 5, 4, P * count * 4, storage_offset_bytes=512)
    with pytest.raises(ho.PlanError, match=r"rank 0 op 'recv1' \(recv from rank 1\): src input\[0:1, 0:4\] of rank 1 "
                                           r"covers bytes \[20, 36\) of a storage of 32 bytes \(at byte 512 of its "
                                           r"allocation\)") as e:
        plan_pulls(comp, 0, layouts)
    assert e.value.rank == 0 and e.value.op == "recv1"
    with pytest.raises(ho.PlanError, match=r"rank 1 op 'self' \(copy\): src input\[1:2, 0:4\] of rank 1 covers "
                                           r"bytes \[36, 52\)"):
        plan_pulls(comp, 1, layouts)  # its own row, past the end as well
    # a layout whose shape is smaller than the plan's box
    layouts[1]["input"] = BufferLayout((1, count), (count, 1), 0, 4, 1024)
    with pytest.raises(ho.PlanError, match=r"src input\[1:2, 0:4\] of rank 1 leaves its buffer of shape \(1, 4\)"):
        plan_pulls(comp, 1, layouts)
    del layouts[1]["input"]
    with pytest.raises(ho.PlanError, match="no layout of rank 1's buffer 'input'"):
        plan_pulls(comp, 0, layouts)
