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


def check_pencil_transposes(global_shape, grid, **simulate_kwargs):
    """Run the four pencil transposes (x->y->z->y->x) of every rank through ``hpdl.offload.simulate`` and
    compare each result with the pencil cut from the global array, exactly."""
    import hpdl.offload as ho

    P = grid[0] * grid[1]
    G = pencil_global(global_shape)
    shapes = plans.pencil_shapes(global_shape, grid)
    bufs = [{"x": pencil(G, global_shape, grid, r, "x"), "y": torch.zeros(shapes["y"]),
             "z": torch.zeros(shapes["z"])} for r in range(P)]
    per_rank = [plans.pencil_transposes(global_shape, grid, r, torch.float32) for r in range(P)]
    for name, which in (("x_to_y", "y"), ("y_to_z", "z"), ("z_to_y", "y"), ("y_to_x", "x")):
        for b in bufs:
            b[which].zero_()
        ho.simulate([pr[name] for pr in per_rank], bufs, **simulate_kwargs)
        for r in range(P):
            assert torch.equal(bufs[r][which], pencil(G, global_shape, grid, r, which)), (name, r)
