"""The 3-D FFT with offloaded, pipelined transposes (hpdl.apps.fft3d.OffloadPencilFFT) on 4 ranks: equal to
the blocking PencilFFT bit for bit and to torch.fft.fftn of the global array, for even and uneven splits and
more slabs than rows (empty slabs); on the agent the transposes run on its native executor."""

import pytest
import torch
import torch.distributed as dist

from hpdl.testing import get_pool

pytestmark = pytest.mark.timeout(240)

CASES = [((8, 6, 10), (2, 2), 3), ((5, 7, 6), (1, 4), 2), ((4, 5, 6), (2, 2), 3)]


def _offloaded_fft(ctx, mode):
    import hpdl.offload as ho
    from hpdl.apps import fft3d
    from hpdl.apps.comm import TorchComm
    from hpdl.offload import native

    agent = ho.Agent(threads=2, timeout=60).start() if mode == "agent" else None
    out = []
    try:
        comm = TorchComm(use_hpdl=False)
        for shape, grid, chunks in CASES:
            fft = fft3d.OffloadPencilFFT(shape, grid, chunks=chunks, progress=mode, timeout=60)
            ref = fft3d.PencilFFT(shape, comm, grid)
            x = fft3d.global_input(shape, fft.input_box(), torch.complex64)
            ys = [fft.forward(x) for _ in range(3)]  # persistent requests, started again
            want = ref.forward(x)
            full = torch.fft.fftn(fft3d.global_input(shape, dtype=torch.complex64))[fft.output_box()]
            on_native = all(r._handle in r._backend.native for r in fft.row_reqs + fft.col_reqs) \
                if mode == "agent" else None
            out.append((all(torch.equal(y, want) for y in ys),
                        float((ys[-1] - full).abs().max() / full.abs().max()),
                        on_native if native.load() is not None else True))
            fft.free()
        dist.barrier()
    finally:
        if agent is not None:
            agent.stop()
    return out


@pytest.mark.parametrize("mode", ["agent", "thread"])
def test_offloaded_pipelined_fft_equals_the_blocking_one(mode):
    for rank_res in get_pool(4).run(_offloaded_fft, mode):
        for (same, err, native), case in zip(rank_res, CASES):
            assert same and err < 1e-5, (case, same, err)
            assert native in (True, None), case


def test_offloaded_fft_argument_errors():
    from hpdl.apps.fft3d import OffloadPencilFFT

    with pytest.raises(ValueError, match="dtype must be torch.complex64"):
        OffloadPencilFFT((4, 4, 4), dtype=torch.float32)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        OffloadPencilFFT((4, 4, 4), chunks=0)
