"""Ready-made plans: Alltoall, Allreduce (ring and direct), halo exchange of 2-D/3-D stencils, and the
all-to-all transposes of a pencil-decomposed 3-D FFT. Each builder is a pure function returning one rank's
:class:`~hpdl.offload.plan.Plan`; compile it on every rank of the group (or use the ``*_init`` shortcuts in
:mod:`hpdl.offload`).
"""

from __future__ import annotations

import math
from typing import Sequence

from hpdl.comm.ops import normalize_op, shard_bounds
from hpdl.offload.plan import Plan, dtype_name


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")


def alltoall(rank: int, world_size: int, count: int, dtype, *, window: int | None = None) -> Plan:
    """Alltoall of ``count`` elements per peer (``MPI_Alltoall``; as ``torch.distributed.all_to_all_single``
    with equal splits).

    Buffers: ``input`` and ``output``, both ``(world_size, count)``: row q of ``input`` goes to rank q, row q of
    ``output`` comes from rank q. Pairwise order: at step k rank r sends to r+k and receives from r-k, so that
    no rank is everyone's first peer; ``window`` (>= 1) keeps at most that many steps in flight (each step's
    ops depend on those ``window`` steps earlier), as MPICH's ``MPIR_CVAR_ALLTOALL_THROTTLE``.
    """
    _check_rank(rank, world_size)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
    p = Plan("alltoall", rank=rank, world_size=world_size)
    x = p.buffer("input", (world_size, count), dtype)
    y = p.buffer("output", (world_size, count), dtype)
    p.copy(y[rank], x[rank], name="self")
    steps = []
    for k in range(1, world_size):
        to, frm = (rank + k) % world_size, (rank - k) % world_size
        after = steps[k - 1 - window] if window is not None and k - 1 - window >= 0 else ()
        steps.append((p.send(x[to], to, after=after, name=f"send{to}"),
                      p.recv(y[frm], frm, after=after, name=f"recv{frm}")))
    return p


def allreduce(rank: int, world_size: int, count: int, dtype, *, op: str = "sum", algorithm: str = "ring",
              window: int | None = None) -> Plan:
    """Allreduce of a ``count``-element buffer ``data``, in place (``MPI_Allreduce`` with ``MPI_IN_PLACE``).

    Args:
        op: sum, prod, min or max (also hpdl.comm's "product" and ``torch.distributed.ReduceOp`` SUM, PRODUCT,
            MIN, MAX; not avg, which a plan cannot divide).
        window: ``direct`` only: at most this many (>= 1) peers in flight (None: all).
        algorithm: ``ring`` (reduce-scatter then all-gather around the ring, 2(p-1) dependent steps;
            Thakur, Rabenseifner and Gropp, IJHPCA 2005) or ``direct`` (Direct Sendrecv: every rank sends block
            q to rank q, which reduces the p-1 blocks it receives in rank order, then sends its block to all;
            ``window`` peers in flight, as hpdl.comm's ``direct``).

    Buffers: ``data`` ``(count,)`` and a scratch buffer ``scratch`` (allocated by compile unless bound).
    Blocks: :func:`blocks` (count need not be divisible by world_size). Each block is reduced by one rank and
    copied to the others, so every rank ends with bitwise-identical data.

    Raises:
        ValueError: a bad ``rank``, ``op``, ``algorithm`` or ``window``, naming it (before any plan is built, so
            a one-rank plan, which has no reduce operation for compile to check, rejects a bad op too).
    """
    _check_rank(rank, world_size)
    if algorithm not in ("ring", "direct"):
        raise ValueError(f"algorithm must be 'ring' or 'direct', got {algorithm!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
    ops = ("sum", "prod", "min", "max")
    try:  # hpdl.comm's spellings (c10d's ReduceOp, "product") map onto the plan's MPI names
        name = normalize_op(op)
    except ValueError:
        name = None
    name = "prod" if name == "product" else name
    if name not in ops:
        raise ValueError(f"op must be one of {ops} (or torch.distributed.ReduceOp SUM, PRODUCT, MIN, MAX), "
                         f"got {op!r}")
    op = name
    p = Plan(f"allreduce_{algorithm}", rank=rank, world_size=world_size)
    P, r = world_size, rank
    blk = shard_bounds(count, P)  # the first count % P blocks one longer (MPI_Reduce_scatter_block style)
    width = max((b - a for a, b in blk), default=0)
    data = p.buffer("data", (count,), dtype)
    if P == 1:
        return p
    if algorithm == "ring":
        scratch = p.buffer("scratch", (2, width), dtype)
        left, right = (r - 1) % P, (r + 1) % P
        red, sends = [], []
        for k in range(P - 1):  # reduce-scatter: after step k, block r-k-1 holds k+2 contributions
            sb, rb = (r - k) % P, (r - k - 1) % P
            n = blk[rb][1] - blk[rb][0]
            sends.append(p.send(data[slice(*blk[sb])], right, tag=0, after=red[-1:], name=f"rs_send{k}"))
            rcv = p.recv(scratch[k % 2, 0:n], left, tag=0, after=red[-2:-1], name=f"rs_recv{k}")
            red.append(p.reduce(data[slice(*blk[rb])], scratch[k % 2, 0:n], op, after=[rcv] + red[-1:],
                                name=f"rs_reduce{k}"))
        prev = red[-1]
        for k in range(P - 1):  # all-gather: rank r owns block r+1 and passes blocks on to the right
            sb, rb = (r + 1 - k) % P, (r - k) % P
            p.send(data[slice(*blk[sb])], right, tag=1, after=[prev], name=f"ag_send{k}")
            prev = p.recv(data[slice(*blk[rb])], left, tag=1, after=[red[-1], sends[k]], name=f"ag_recv{k}")
        return p
    scratch = p.buffer("scratch", (P - 1, width), dtype)
    mine = slice(*blk[r])
    n = blk[r][1] - blk[r][0]
    rs, sent_to, last = [], {}, []
    for j in range(1, P):
        to, frm = (r + j) % P, (r - j) % P
        after = rs[j - 1 - window] if window is not None and j - 1 - window >= 0 else ()
        s = p.send(data[slice(*blk[to])], to, tag=0, after=after, name=f"rs_send{to}")
        v = p.recv(scratch[j - 1, 0:n], frm, tag=0, after=after, name=f"rs_recv{frm}")
        rs.append((s, v))
        sent_to[to] = s
        last = [p.reduce(data[mine], scratch[j - 1, 0:n], op, after=[v] + last, name=f"rs_reduce{frm}")]
    ag = []
    for j in range(1, P):
        to, frm = (r + j) % P, (r - j) % P
        after = list(ag[j - 1 - window]) if window is not None and j - 1 - window >= 0 else []
        s = p.send(data[mine], to, tag=1, after=last + after, name=f"ag_send{to}")
        v = p.recv(data[slice(*blk[frm])], frm, tag=1, after=[sent_to[frm]] + after, name=f"ag_recv{frm}")
        ag.append((s, v))
    return p


def grid_coords(rank: int, grid: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinates of ``rank`` in a process grid (the last dimension varies fastest)."""
    out = []
    for g in reversed(grid):
        out.append(rank % g)
        rank //= g
    return tuple(reversed(out))


def grid_rank(coords: Sequence[int], grid: Sequence[int]) -> int:
    r = 0
    for c, g in zip(coords, grid):
        r = r * g + c
    return r


def halo(shape: Sequence[int], grid: Sequence[int], rank: int, dtype, *, width: int = 1,
         periodic: bool | Sequence[bool] = True, corners: bool = False, buffer: str = "u") -> Plan:
    """Halo exchange of an N-d block-decomposed array (the 2-D/3-D stencil pattern).

    Args:
        shape: the owned block's shape (n_0, ..., n_{d-1}); the buffer is ``shape + 2*width`` per dimension,
            owned cells at ``[width, n_i + width)``.
        grid: process grid (p_0, ..., p_{d-1}); ranks are numbered row-major (:func:`grid_coords`).
        periodic: per dimension (or one bool): wrap around; otherwise the outer halo of edge ranks is not
            touched. A periodic dimension of one rank exchanges with itself (a local copy).
        corners: also fill edge and corner halo cells (for 9-/27-point stencils): dimensions are exchanged in
            order, each sending slabs that include the halos already received in earlier dimensions (those
            sends depend on those receives); without it, faces only (5-/7-point stencils), all at once.

    Tags: 2*dim for data moving up (to the neighbour of higher coordinate), 2*dim+1 for down.
    """
    shape, grid = tuple(shape), tuple(grid)
    d = len(shape)
    if len(grid) != d:
        raise ValueError(f"grid {grid} must have one entry per dimension of shape {shape}")
    if any(g < 1 for g in grid):
        raise ValueError(f"grid entries must be >= 1, got {grid}")
    world = math.prod(grid)
    _check_rank(rank, world)
    if width < 1 or any(n < width for n in shape):
        raise ValueError(f"width must be >= 1 and <= every owned extent {shape}, got {width}")
    per = (periodic,) * d if isinstance(periodic, bool) else tuple(periodic)
    if len(per) != d:
        raise ValueError(f"periodic must be a bool or have {d} entries, got {periodic!r}")
    h = width
    p = Plan(f"halo{d}d", rank=rank, world_size=world)
    u = p.buffer(buffer, tuple(n + 2 * h for n in shape), dtype)
    me = grid_coords(rank, grid)
    received = []
    for i in range(d):
        def box(lo, hi, i=i):
            idx = []
            for j in range(d):
                if j == i:
                    idx.append(slice(lo, hi))
                elif corners and j < i:
                    idx.append(slice(0, shape[j] + 2 * h))
                else:
                    idx.append(slice(h, shape[j] + h))
            return u[tuple(idx)]

        after = list(received) if corners else []
        now = []
        for s in (+1, -1):
            c = me[i] + s
            if not 0 <= c < grid[i]:
                if not per[i]:
                    continue
                c %= grid[i]
            peer = grid_rank(me[:i] + (c,) + me[i + 1:], grid)
            up = s > 0
            send_box = box(shape[i], shape[i] + h) if up else box(h, 2 * h)
            recv_box = box(shape[i] + h, shape[i] + 2 * h) if up else box(0, h)
            # my face toward +1 travels up (tag 2i); what I receive from +1 travels down (tag 2i+1)
            p.send(send_box, peer, tag=2 * i + (0 if up else 1), after=after,
                   name=f"send_d{i}{'+' if up else '-'}")
            now.append(p.recv(recv_box, peer, tag=2 * i + (1 if up else 0), after=after,
                              name=f"recv_d{i}{'+' if up else '-'}"))
        received.extend(now)
    return p


def halo2d(shape, grid, rank, dtype, **kw) -> Plan:
    """:func:`halo` of a 2-D array (5-point stencil; ``corners=True`` for 9-point)."""
    if len(shape) != 2:
        raise ValueError(f"halo2d needs a 2-D shape, got {shape}")
    return halo(shape, grid, rank, dtype, **kw)


def halo3d(shape, grid, rank, dtype, **kw) -> Plan:
    """:func:`halo` of a 3-D array (7-point stencil; ``corners=True`` for 27-point)."""
    if len(shape) != 3:
        raise ValueError(f"halo3d needs a 3-D shape, got {shape}")
    return halo(shape, grid, rank, dtype, **kw)


def pencil_shapes(global_shape: Sequence[int], grid: Sequence[int]) -> dict[str, tuple[int, int, int]]:
    """Local array shapes of the x-, y- and z-pencils of a ``(NZ, NY, NX)`` array on a ``(P1, P2)`` grid.

    Axes keep their order (z, y, x); x-pencil: z split over P1, y over P2, x whole; y-pencil: z over P1,
    x over P2; z-pencil: y over P1, x over P2 (P3DFFT's layout, 2decomp&FFT's naming).

    Raises:
        ValueError: an extent not divisible by the grid dimension it is split over.
    """
    NZ, NY, NX = global_shape
    P1, P2 = grid
    for name, n, q in (("NX", NX, P2), ("NY", NY, P2), ("NY", NY, P1), ("NZ", NZ, P1)):
        if n % q:
            raise ValueError(f"pencils of {tuple(global_shape)} on grid {tuple(grid)}: {name}={n} must be "
                             f"divisible by {q}")
    return {"x": (NZ // P1, NY // P2, NX), "y": (NZ // P1, NY, NX // P2), "z": (NZ, NY // P1, NX // P2)}


def pencil_box(global_shape, grid, rank: int, pencil: str) -> tuple[tuple[int, int], ...]:
    """Global ``[start, stop)`` per axis (z, y, x) of ``rank``'s ``pencil`` ('x', 'y' or 'z')."""
    sh = pencil_shapes(global_shape, grid)[pencil]
    r1, r2 = divmod(rank, grid[1])
    pos = {"x": (r1, r2, 0), "y": (r1, 0, r2), "z": (0, r1, r2)}[pencil]
    return tuple((c * n, (c + 1) * n) for c, n in zip(pos, sh))


def pencil_transposes(global_shape: Sequence[int], grid: Sequence[int], rank: int, dtype) -> dict[str, Plan]:
    """The four all-to-all transposes of a pencil-decomposed 3-D FFT: ``x_to_y`` and ``y_to_z`` (forward),
    ``z_to_y`` and ``y_to_x`` (backward). Rank = r1 * P2 + r2; ``x_to_y`` and ``y_to_x`` are alltoalls among
    the P2 ranks of a row (same r1), ``y_to_z`` and ``z_to_y`` among the P1 ranks of a column (same r2).

    Buffers ``x``, ``y``, ``z`` (shapes from :func:`pencil_shapes`), registered by all four plans so that
    the same three tensors bind to each. Blocks are 3-D boxes: an agent copies them
    between ranks of a node without packing; only transfers between nodes are packed.
    """
    shapes = pencil_shapes(global_shape, grid)
    dt = dtype_name(dtype)
    P1, P2 = grid
    world = P1 * P2
    _check_rank(rank, world)
    r1, r2 = divmod(rank, P2)
    NZ, NY, NX = global_shape

    def part(n, q, i):
        return slice(i * (n // q), (i + 1) * (n // q))

    def exchange(name, a, b, peers, mine, send_box, recv_box):
        p = Plan(name, rank=rank, world_size=world)
        refs = {k: p.buffer(k, shapes[k], dt) for k in ("x", "y", "z")}
        src, dst = refs[a], refs[b]
        n = len(peers)
        p.copy(dst[recv_box(mine)], src[send_box(mine)], name="self")
        for k in range(1, n):
            to, frm = (mine + k) % n, (mine - k) % n
            p.send(src[send_box(to)], peers[to], name=f"send{peers[to]}")
            p.recv(dst[recv_box(frm)], peers[frm], name=f"recv{peers[frm]}")
        return p

    row = [r1 * P2 + j for j in range(P2)]
    col = [i * P2 + r2 for i in range(P1)]
    all_ = slice(None)
    return {
        "x_to_y": exchange("x_to_y", "x", "y", row, r2, lambda j: (all_, all_, part(NX, P2, j)),
                           lambda i: (all_, part(NY, P2, i), all_)),
        "y_to_z": exchange("y_to_z", "y", "z", col, r1, lambda j: (all_, part(NY, P1, j), all_),
                           lambda i: (part(NZ, P1, i), all_, all_)),
        "z_to_y": exchange("z_to_y", "z", "y", col, r1, lambda j: (part(NZ, P1, j), all_, all_),
                           lambda i: (all_, part(NY, P1, i), all_)),
        "y_to_x": exchange("y_to_x", "y", "x", row, r2, lambda j: (all_, part(NY, P2, j), all_),
                           lambda i: (all_, all_, part(NX, P2, i))),
    }
