"""The native executor (hpdl.offload.native: plans flattened into arrays, run by C threads): every ready-made
plan exact against brute force, with one thread and with workers; the flattening of strided boxes into byte
segments; failure of a request whose partner is freed; and the clean fall-back where no compiler exists."""

import logging

import pytest
import torch

import hpdl.offload as ho
from hpdl.offload import native, plans

import _oracles as O

needs_native = pytest.mark.skipif(native.load() is None, reason="native executor unavailable (no C compiler, or HPDL_OFFLOAD_NATIVE=0)")
THREADS = [1, 3]


@needs_native
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("P,count,window", [(1, 3, None), (2, 0, None), (3, 7, 1), (8, 33, None), (5, 1000, 2)])
def test_alltoall(threads, P, count, window):
    ps = [plans.alltoall(r, P, count, torch.int32, window=window) for r in range(P)]
    ins = [torch.arange(P * count, dtype=torch.int32).view(P, count) + 1000 * r for r in range(P)]
    stats = {}
    out = ho.simulate(ps, [{"input": x} for x in ins], engine="native", copy_threads=threads, starts=3, stats=stats)
    for r in range(P):
        assert torch.equal(out[r]["output"], torch.stack([ins[q][r] for q in range(P)]))
    assert stats["bytes"] == 3 * P * (P - 1) * count * 4 + 3 * P * count * 4 * (P > 0)  # peers' rows + own row


@needs_native
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("P", [2, 3, 5])
def test_allreduce_every_op_and_dtype(threads, algorithm, P):
    for count in sorted({0, 1, P + 1, 97, 40000}):
        for op, dtype in (("sum", torch.float32), ("max", torch.int64), ("min", torch.float64),
                          ("prod", torch.int32), ("sum", torch.float64), ("min", torch.int32)):
            xs = [(torch.arange(count) % 5 + r + 1).to(dtype) for r in range(P)]
            want = {"sum": lambda: sum(xs), "prod": lambda: torch.stack(xs).prod(0).to(dtype),
                    "max": lambda: torch.stack(xs).max(0).values, "min": lambda: torch.stack(xs).min(0).values}[op]()
            ps = [plans.allreduce(r, P, count, dtype, op=op, algorithm=algorithm,
                                  window=2 if algorithm == "direct" else None) for r in range(P)]
            out = ho.simulate(ps, [{"data": x.clone()} for x in xs], engine="native", copy_threads=threads)
            for r in range(P):
                assert torch.equal(out[r]["data"], want.to(dtype)), (op, dtype, count, r)


@needs_native
def test_reduce_min_max_propagate_nan_as_torch():
    p = ho.Plan("nan", rank=0, world_size=1)
    a, b = p.buffer("a", (4,), torch.float32), p.buffer("b", (4,), torch.float32)
    p.reduce(a[...], b[...], "min")
    x = torch.tensor([1.0, float("nan"), 3.0, -1.0])
    y = torch.tensor([2.0, 0.0, float("nan"), -2.0])
    out = ho.simulate([p], [{"a": x.clone(), "b": y.clone()}], engine="native")
    assert torch.equal(out[0]["a"].isnan(), torch.minimum(x, y).isnan())
    assert out[0]["a"][0] == 1.0 and out[0]["a"][3] == -2.0


@needs_native
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("shape,grid", [((3, 4), (2, 3)), ((3, 2, 2), (2, 1, 2)), ((2, 3, 2), (2, 2, 2))])
@pytest.mark.parametrize("corners", [False, True])
def test_halo(threads, shape, grid, corners):
    G, bufs = O.halo_buffers(shape, grid, 1)
    P = len(bufs)
    ps = [plans.halo(shape, grid, r, torch.float32, periodic=True, corners=corners) for r in range(P)]
    out = ho.simulate(ps, [{"u": b} for b in bufs], engine="native", copy_threads=threads)
    for r in range(P):
        assert torch.equal(out[r]["u"], O.halo_expected(G, shape, grid, r, 1, True, corners)), r


@needs_native
@pytest.mark.parametrize("global_shape,grid", [((4, 6, 6), (2, 3)), ((6, 6, 3), (3, 1))])
def test_pencil_transposes(global_shape, grid):
    O.check_pencil_transposes(global_shape, grid, engine="native", copy_threads=2)


@needs_native
@pytest.mark.parametrize("threads", THREADS)
def test_many_small_segments_grouped_into_pieces(threads):
    """Strided boxes of 32-byte runs (4096 of them, 128 KiB: several grouped pieces, as the FFT's row
    transpose), a contiguous 256 KiB message (cut into pieces) and a reduction over strided boxes, in one
    pass: exact, and every byte counted once."""
    rows = 4096
    ps, bufs = [], []
    for r in range(2):
        p = ho.Plan("small", rank=r, world_size=2)
        x = p.buffer("x", (rows, 16), torch.float32)
        y = p.buffer("y", (rows, 8), torch.float32)
        z = p.buffer("z", (rows, 16), torch.float32)
        big = p.buffer("big", (1 << 16,), torch.float32)
        p.send(x[:, 4:12], 1 - r)
        p.recv(y[...], 1 - r)
        p.send(big[...], 1 - r, tag=1)
        p.recv(z[:, 0:16], 1 - r, tag=1)
        p.reduce(x[:, 12:16], x[:, 0:4], "sum")
        ps.append(p)
        bufs.append({"x": torch.arange(rows * 16, dtype=torch.float32).view(rows, 16) + 1e6 * r,
                     "y": torch.zeros(rows, 8), "z": torch.zeros(rows, 16),
                     "big": torch.arange(1 << 16, dtype=torch.float32) - r})
    want = [{k: v.clone() for k, v in b.items()} for b in bufs]
    stats = {}
    out = ho.simulate(ps, bufs, engine="native", copy_threads=threads, stats=stats)
    for r in range(2):
        q = 1 - r
        assert torch.equal(out[r]["y"], want[q]["x"][:, 4:12])
        assert torch.equal(out[r]["z"].view(-1), want[q]["big"])
        assert torch.equal(out[r]["x"][:, 12:16], want[r]["x"][:, 12:16] + want[r]["x"][:, 0:4])
        assert torch.equal(out[r]["x"][:, :12], want[r]["x"][:, :12])
    assert stats["bytes"] == 2 * (rows * 8 * 4 + (1 << 16) * 4 + rows * 4 * 4)
    # a worker takes ~64 KiB per atomic, not one 32-byte run: 2 x (2 + 4 + 1) pieces, not 2 x (4096 + 4 + 4096)
    assert stats["pieces"] <= 2 * (2 + 4 + 1), stats


@pytest.mark.parametrize("dst_box,src_box", [
    ((slice(1, 3), slice(0, 4)), (slice(0, 2), slice(0, 4))),   # whole rows: one segment
    ((slice(0, 4), slice(1, 2)), (slice(2, 3), slice(0, 4))),   # a column <- a row
    ((slice(1, 3), slice(1, 4)), (slice(0, 3), slice(2, 4))),   # 2x3 <- 3x2 (C-order element stream)
])
def test_segments_move_c_order_element_streams(dst_box, src_box):
    src = torch.arange(16, dtype=torch.float32).view(4, 4)
    dst = torch.full((4, 4), -1.0)
    d, s = dst[dst_box], src[src_box]
    segs = native.segments(d, s)
    assert segs[:, 2].sum() == s.numel() * 4
    raw = torch.full((4, 4), -1.0)
    for sa, da, n in segs.tolist():  # replay the segments by address offsets
        so, do = (sa - src.data_ptr()) // 4, (da - dst.data_ptr()) // 4
        raw.view(-1)[do:do + n // 4] = src.view(-1)[so:so + n // 4]
    d.copy_(s.reshape(d.shape))
    assert torch.equal(raw, dst)
    if dst_box[1] == slice(0, 4):
        assert len(segs) == 1  # contiguous on both sides: merged


@needs_native
def test_a_waiting_half_fails_when_its_partner_is_freed():
    import numpy as np

    from hpdl.offload import shm
    from hpdl.offload.compiler import compile_group
    from hpdl.offload.executor import Instance

    ps = [plans.alltoall(r, 2, 4, torch.float32).data() for r in range(2)]
    compiled = compile_group(ps, key=1, endpoints=[0, 0])
    boxes = shm.Mailboxes(2, shared=False)
    insts = [Instance(c, {"input": torch.ones(2, 4), "output": torch.zeros(2, 4)}, boxes.array, q, None, "t",
                      f"rank {q}") for q, c in enumerate(compiled)]
    bell = np.zeros(2, dtype=np.uint32)
    eng = native.NativeEngine(native.load(), bell.ctypes.data)
    try:
        ids = [eng.register(i) for i in insts]
        boxes.array[0, shm.START] = 1  # rank 0 starts, rank 1 never does
        eng.ring()
        for _ in range(500):
            st = eng.status(ids[0])
            if any("matching half" in p.state for p in st.pending):
                break
            native.futex_wait(bell.ctypes.data + 4, 0, 0.01)
        assert any("waits for rank 1's matching half" in p.state for p in eng.status(ids[0]).pending)
        eng.free(ids[1], "left (its process ended)")
        assert boxes.array[0, shm.FAILED] == 1 and boxes.array[0, shm.DONE] == 0
        err = eng.status(ids[0]).error
        assert "rank 1 left (its process ended)" in err and "rank 0" in err, err
    finally:
        eng.close()


def test_without_a_compiler_the_python_executor_is_used_with_one_log_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native, "_LIB", [])
    monkeypatch.setenv("HPDL_OFFLOAD_NATIVE", "auto")
    monkeypatch.setenv("CC", "/nonexistent/gcc")
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no cc
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="hpdl.offload"):
        assert native.load() is None
        assert native.load() is None
    lines = [r.getMessage() for r in caplog.records if "native executor unavailable" in r.getMessage()]
    assert len(lines) == 1 and "no C compiler" in lines[0] and "Python executor" in lines[0], lines
    monkeypatch.setenv("HPDL_OFFLOAD_NATIVE", "1")
    with pytest.raises(native.NativeUnavailable, match="HPDL_OFFLOAD_NATIVE=1"):
        native.load()
    with pytest.raises(native.NativeUnavailable):
        ho.simulate([plans.alltoall(0, 1, 2, torch.float32)], [{}], engine="native")


def test_native_off_by_environment(monkeypatch):
    monkeypatch.setenv("HPDL_OFFLOAD_NATIVE", "0")
    assert native.load() is None


@pytest.mark.parametrize("value", ["2", "maybe", "native"])
def test_bad_native_setting_is_named(monkeypatch, value):
    # it was taken as auto without a word
    monkeypatch.setenv("HPDL_OFFLOAD_NATIVE", value)
    with pytest.raises(ValueError, match="HPDL_OFFLOAD_NATIVE must be auto, 1.*or 0"):
        native.load()


@pytest.mark.parametrize("value", ["a,b", "0,100000", "-1"])
def test_bad_core_list_is_named(monkeypatch, value):
    # "a,b" raised int()'s bare message; cores off this host were passed to the engine, which pinned nothing
    monkeypatch.setenv("HPDL_OFFLOAD_CORES", value)
    with pytest.raises(ValueError, match="HPDL_OFFLOAD_CORES"):
        native.default_cpus(1)
    monkeypatch.setenv("HPDL_OFFLOAD_CORES", "0")
    assert native.default_cpus(1) == [0]
