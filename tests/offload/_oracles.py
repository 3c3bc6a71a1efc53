"""Brute-force expected results of the ready-made plans, from a global array (shared by pure and rank tests)."""

import itertools

import torch

from hpdl.offload import plans

SENTINEL = -7.0


def halo_buffers(shape, grid, width, dtype=torch.float32):
    """(global array, per-rank buffers with owned cells from it and SENTINEL halos)."""
    gshape = tuple(n * g for n, g in zip(shape, grid))
    G = torch.arange(1, 1 + torch.tensor(gshape).prod().item(), dtype=torch.float64).view(gshape).to(dtype)
    bufs = []
    for r in range(int(torch.tensor(grid).prod())):
        c = plans.grid_coords(r, grid)
        u = torch.full(tuple(n + 2 * width for n in shape), SENTINEL, dtype=dtype)
        own = tuple(slice(width, n + width) for n in shape)
        u[own] = G[tuple(slice(ci * n, (ci + 1) * n) for ci, n in zip(c, shape))]
        bufs.append(u)
    return G, bufs


def halo_expected(G, shape, grid, rank, width, periodic, corners, dtype=torch.float32):
    """Rank's buffer after a correct halo exchange: owned cells, then each halo cell from its global source
    (wrapped in periodic dimensions), SENTINEL where nothing is exchanged."""
    d = len(shape)
    per = (periodic,) * d if isinstance(periodic, bool) else tuple(periodic)
    c = plans.grid_coords(rank, grid)
    out = torch.full(tuple(n + 2 * width for n in shape), SENTINEL, dtype=dtype)
    gshape = G.shape
    for idx in itertools.product(*[range(n + 2 * width) for n in shape]):
        halo_dims = [i for i in range(d) if not width <= idx[i] < shape[i] + width]
        if len(halo_dims) > 1 and not corners:
            continue
        gi, ok = [], True
        for i in range(d):
            g = c[i] * shape[i] + idx[i] - width
            if not 0 <= g < gshape[i]:
                if not per[i]:
                    ok = False
                    break
                g %= gshape[i]
            gi.append(g)
        if ok:
            out[idx] = G[tuple(gi)]
    return out


def pencil_global(global_shape, dtype=torch.float32):
    n = global_shape[0] * global_shape[1] * global_shape[2]
    return (torch.arange(n, dtype=torch.float64) % 1000003).view(global_shape).to(dtype)


def pencil(G, global_shape, grid, rank, which):
    return G[tuple(slice(a, b) for a, b in plans.pencil_box(global_shape, grid, rank, which))].contiguous()
