"""Expert placement minimising cross-GPU token transitions (ExFlow, arXiv 2401.08383, section 4).

A placement is ``ranks [L, E]`` int: the GPU (expert-parallel rank) of expert ``e`` at MoE layer ``l``, with exactly
``E/G`` experts per GPU per layer. In ExFlow's context-coherent mode a token stays on its expert's GPU after a
MoE layer, so it crosses GPUs only when its next expert lives elsewhere: the dispatch Alltoall volume is the
number of cross-GPU transitions times the hidden size.

Integer program over aggregated transition counts ``C [L-1, E, E]`` (:mod:`hpdl.moe.affinity`), whose size does
not depend on the token count (``L*E*G`` binaries plus one continuous ``y`` per non-zero count)::

    min  sum_{l,i,j} C[l,i,j] * (c_gpu * y[l,i,j] + (c_node - c_gpu) * z[l,i,j])
    s.t. sum_g x[l,e,g] = 1                     every expert on one GPU
         sum_e x[l,e,g] = E/G                   balanced
         y[l,i,j] >= x[l,i,g] - x[l+1,j,g]      for every GPU g  (y = 1 iff i and j on different GPUs)
         z[l,i,j] >= X[l,i,n] - X[l+1,j,n]      for every node n (X = sum of x over the node's GPUs)
         sum_e n[l,e] x[l,e,g] <= (1+eps) N_l/G + s_l  token load per GPU (soft: + 100 s_l in the objective)
         x[0,0,0] = 1                            GPUs are interchangeable: break one symmetry

solved with ``scipy.optimize.milp`` (HiGHS) under a time limit. For G >= 4 (a power of two) :func:`bisect`
splits recursively into halves (nodes first, then GPUs, as the ExFlow repository's "bipart" does), each half a
G=2 program; :func:`greedy` (per-layer optimal assignment given the neighbours, ``linear_sum_assignment``) is the
fallback and is kept when it beats a time-limited ILP and meets the load bound. Balancing expert *counts* alone
let one GPU hold half of a layer's tokens at G=4; the load row (``load_eps``, default 0.1; None drops it) bounds
that, and :func:`load_share` reports the busiest GPU's share. With ``ranks_per_node`` the paper's two-stage solve
(:func:`two_stage`: nodes first on the whole problem, then GPUs inside each node) is the default.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hpdl.moe.errors import MoEError, PlacementError

FORMAT = "hpdl.moe.placement/1"


def _check_counts(C: np.ndarray, G: int) -> tuple[int, int]:
    C = np.asarray(C)
    if C.ndim != 3 or C.shape[1] != C.shape[2]:
        raise MoEError(f"counts must be [L-1, E, E], got shape {C.shape}")
    E = C.shape[1]
    if G < 1 or E % G:
        raise MoEError(f"world_size={G} must divide n_experts={E}")
    return C.shape[0] + 1, E


def _time_limit(value: float | None) -> float:
    from hpdl.runtime import env

    t = float(env.get("HPDL_MOE_ILP_TIME_LIMIT") if value is None else value)
    if t <= 0:
        raise MoEError(f"time_limit must be > 0 seconds, got {t}")
    return t


def validate(ranks: np.ndarray, world_size: int) -> np.ndarray:
    """``ranks [L, E]`` -> itself as int64; raises PlacementError unless every layer puts E/G experts per rank."""
    try:
        a = np.asarray(ranks)
    except ValueError as e:  # ragged nested lists
        raise PlacementError(f"placement must be a rectangular [layers, experts] array ({e})") from None
    if a.ndim != 2:
        raise PlacementError(f"placement must be [layers, experts], got shape {a.shape}")
    if a.size and (not np.issubdtype(a.dtype, np.number) or (a != np.round(a)).any()):
        raise PlacementError(f"placement entries must be integer ranks, got dtype {a.dtype}")
    r = a.astype(np.int64)
    E = r.shape[1]
    if world_size < 1 or E % world_size:
        raise PlacementError(f"world_size={world_size} must divide n_experts={E}")
    if r.size and (r.min() < 0 or r.max() >= world_size):
        raise PlacementError(f"placement ranks must be in [0, world_size={world_size}), got [{r.min()}, {r.max()}]")
    for l, row in enumerate(r):
        cnt = np.bincount(row, minlength=world_size)
        if len(cnt) != world_size or (cnt != E // world_size).any():
            raise PlacementError(f"layer {l}: experts per rank {cnt.tolist()}, expected {E // world_size} on each "
                                 f"of world_size={world_size} ranks")
    return r


def contiguous(n_layers: int, n_experts: int, world_size: int) -> np.ndarray:
    """The naive placement: experts ``[g*E/G, (g+1)*E/G)`` on rank g at every layer."""
    if n_experts % world_size:
        raise MoEError(f"world_size={world_size} must divide n_experts={n_experts}")
    return np.tile(np.arange(n_experts) // (n_experts // world_size), (n_layers, 1))


def random_placement(n_layers: int, n_experts: int, world_size: int, seed: int = 0) -> np.ndarray:
    """A uniformly random balanced placement (independent per layer)."""
    rng = np.random.default_rng(seed)
    base = contiguous(1, n_experts, world_size)[0]
    return np.stack([rng.permutation(base) for _ in range(n_layers)])


def cross_share(C: np.ndarray, ranks: np.ndarray, ranks_per_node: int | None = None) -> float:
    """Share of transitions (weighted by ``C [L-1, E, E]``) whose two experts are on different GPUs, or, with
    ``ranks_per_node``, on different nodes (node of rank g = g // ranks_per_node)."""
    r = np.asarray(ranks)
    C = np.asarray(C)
    if C.ndim != 3 or r.ndim != 2 or C.shape != (r.shape[0] - 1, r.shape[1], r.shape[1]):
        raise MoEError(f"counts of shape {C.shape} need a placement of shape ({C.shape[0] + 1 if C.ndim == 3 else '?'}"
                       f", {C.shape[-1]}), got {r.shape}")
    if ranks_per_node:
        r = r // ranks_per_node
    tot = C.sum()
    if tot == 0:
        return 0.0
    diff = r[:-1, :, None] != r[1:, None, :]
    return float((C * diff).sum() / tot)


def objective(C: np.ndarray, ranks: np.ndarray, ranks_per_node: int | None = None,
              gpu_cost: float = 1.0, node_cost: float = 2.0) -> float:
    """Mean hop cost per transition: ``gpu_cost`` within a node, ``node_cost`` across nodes, 0 on one GPU."""
    cost = gpu_cost * cross_share(C, ranks)
    if ranks_per_node:
        cost += (node_cost - gpu_cost) * cross_share(C, ranks, ranks_per_node)
    return cost


def expert_load(C: np.ndarray) -> np.ndarray:
    """Tokens routed to each expert of each MoE layer, ``[L, E]``, from the transition counts ``C [L-1, E, E]``
    (row sums for layers 0..L-2, column sums of the last transition for layer L-1)."""
    C = np.asarray(C, float)
    return np.concatenate([C.sum(2), C[-1].sum(0)[None]], 0)


def load_share(C: np.ndarray, ranks: np.ndarray) -> dict:
    """Busiest rank of every layer: ``{"max_share": float, "per_layer": [L] shares, "ideal": 1/G}``; the share is
    that rank's fraction of the layer's routed tokens (1/G is perfectly balanced)."""
    n = expert_load(C)
    r = np.asarray(ranks)
    G = int(r.max()) + 1 if r.size else 1
    per = []
    for l in range(n.shape[0]):
        tot = n[l].sum()
        per.append(float(np.bincount(r[l], weights=n[l], minlength=G).max() / tot) if tot else 0.0)
    return {"max_share": max(per, default=0.0), "per_layer": per, "ideal": 1.0 / max(1, G)}


LOAD_PENALTY = 100.0  # objective weight of one layer's token share above the bound (transitions weigh <= 2)


def load_excess(C: np.ndarray, ranks: np.ndarray, world_size: int, load_eps: float | None) -> float:
    """Sum over layers of the busiest rank's token share above ``(1 + load_eps) / G`` (0 when within the
    bound or when ``load_eps`` is None): what the ILP's soft load rows penalise."""
    if load_eps is None:
        return 0.0
    n = expert_load(C)
    out = 0.0
    for l in range(n.shape[0]):
        tot = n[l].sum()
        if tot:
            mx = np.bincount(np.asarray(ranks)[l], weights=n[l], minlength=world_size).max() / tot
            out += max(0.0, mx - (1 + load_eps) / world_size)
    return out


def _load_ok(C, ranks, G, load_eps, than: np.ndarray | None = None) -> bool:
    """``ranks`` exceeds the load bound no more than ``than`` does (or than 0)."""
    ref = load_excess(C, than, G, load_eps) if than is not None else 0.0
    return load_excess(C, ranks, G, load_eps) <= ref + 1e-9


@dataclass
class PlacementResult:
    """Output of :func:`place`: ``ranks [L, E]`` plus how it was found (plain data, JSON-able)."""

    ranks: np.ndarray
    method: str
    status: str
    objective: float
    seconds: float
    world_size: int
    ranks_per_node: int | None = None
    details: dict = field(default_factory=dict)

    def to_json(self, **meta) -> dict:
        d = asdict(self)
        d["ranks"] = np.asarray(self.ranks).tolist()
        d.update(format=FORMAT, n_experts=int(self.ranks.shape[1]), n_layers=int(self.ranks.shape[0]), **meta)
        return d

    def save(self, path: str | Path, **meta) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(**meta), indent=1))
        return path


def load_placement(path: str | Path, world_size: int | None = None, n_layers: int | None = None,
                   n_experts: int | None = None, model_config: str | None = None) -> np.ndarray:
    """Read a placement JSON (``ranks [L, E]``) and check it against the engine's world size and model.

    ``model_config`` (``MoEConfig.identity()``) is compared with the config hash the file got from its trace,
    when the file has one: a placement fitted on another architecture is refused even if its shape fits.

    Raises:
        PlacementError: not JSON, wrong format, no ``ranks``/``world_size``, entries that are not ranks in
            ``[0, world_size)``, unbalanced, or world_size / n_layers / n_experts / model config differ (named).
    """
    try:
        d = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlacementError(f"path={path}: not a placement JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise PlacementError(f"path={path}: format {got!r}, expected {FORMAT!r}")
    for key in ("ranks", "world_size"):
        if key not in d:
            raise PlacementError(f"path={path}: no {key!r} entry")
    if not isinstance(d["world_size"], int) or isinstance(d["world_size"], bool):
        raise PlacementError(f"path={path}: world_size must be an int, got {d['world_size']!r}")
    r = validate(d["ranks"], d["world_size"])
    for name, want, got in (("world_size", world_size, d["world_size"]), ("n_layers", n_layers, r.shape[0]),
                            ("n_experts", n_experts, r.shape[1])):
        if want is not None and want != got:
            raise PlacementError(f"placement {path}: {name}={got}, the engine expects {name}={want}")
    have = (d.get("model") or {}).get("config") if isinstance(d.get("model"), dict) else None
    if model_config is not None and have is not None and have != model_config:
        raise PlacementError(f"placement {path}: fitted on model config {have}, the engine's model has "
                             f"config {model_config}")
    return r


def ilp(C: np.ndarray, world_size: int, ranks_per_node: int | None = None, time_limit: float | None = None,
        gpu_cost: float = 1.0, node_cost: float = 2.0, load_eps: float | None = 0.1
        ) -> tuple[np.ndarray | None, dict]:
    """Solve the aggregated ILP directly (see module docstring) with HiGHS. ``load_eps``: routed tokens per GPU
    per layer at most ``(1 + load_eps) * N_l / G``, as a soft row (a penalised slack per layer, weight
    :data:`LOAD_PENALTY`, because a hot expert can make the hard bound infeasible); None drops the rows.

    Returns ``(ranks [L, E] or None when no feasible point was found, info)``; info holds the HiGHS status,
    message, MIP gap, variables and seconds.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    time_limit = _time_limit(time_limit)
    L, E = _check_counts(C, world_size)
    G = world_size
    if G == 1:
        return np.zeros((L, E), dtype=np.int64), {"status": "trivial"}
    nodes = None
    if ranks_per_node and ranks_per_node < G:
        if G % ranks_per_node:
            raise MoEError(f"ranks_per_node={ranks_per_node} must divide world_size={G}")
        nodes = [list(range(n, n + ranks_per_node)) for n in range(0, G, ranks_per_node)]
    nx = L * E * G
    xi = lambda l, e, g: (l * E + e) * G + g  # noqa: E731
    nz = np.argwhere(C > 0)  # [T, 3] (l, i, j)
    T = len(nz)
    ny = T
    nzv = T if nodes else 0
    ns = nx + ny + nzv  # first slack of the soft load rows (one per layer)
    nvar = ns + (L if load_eps is not None else 0)
    c = np.zeros(nvar)
    c[ns:] = LOAD_PENALTY
    w = C[nz[:, 0], nz[:, 1], nz[:, 2]] / C.sum()
    c[nx:nx + ny] = gpu_cost * w
    if nodes:
        c[nx + ny:ns] = (node_cost - gpu_cost) * w
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def add(idx, coef, lb, ub):
        nonlocal r
        rows.extend([r] * len(idx))
        cols.extend(idx)
        vals.extend(coef)
        lo.append(lb)
        hi.append(ub)
        r += 1

    if load_eps is not None and load_eps < 0:
        raise MoEError(f"load_eps must be >= 0 or None, got {load_eps}")
    n_tok = expert_load(C)
    for l in range(L):
        for e in range(E):
            add([xi(l, e, g) for g in range(G)], [1.0] * G, 1, 1)
        for g in range(G):
            add([xi(l, e, g) for e in range(E)], [1.0] * E, E // G, E // G)
        if load_eps is not None and n_tok[l].sum() > 0:
            # soft: share_g - s_l <= (1 + eps)/G, s_l >= 0 penalised (a hot expert can make the bound infeasible)
            for g in range(G):
                add([xi(l, e, g) for e in range(E)] + [ns + l], (n_tok[l] / n_tok[l].sum()).tolist() + [-1.0],
                    -np.inf, (1 + load_eps) / G)
    # vectorised linking rows: y_t - x[l,i,g] + x[l+1,j,g] >= 0
    l, i, j = nz[:, 0], nz[:, 1], nz[:, 2]
    for g in range(G):
        rr = r + np.arange(T)
        rows.extend(np.repeat(rr, 3).tolist())
        cols.extend(np.stack([nx + np.arange(T), (l * E + i) * G + g, ((l + 1) * E + j) * G + g], 1).ravel().tolist())
        vals.extend([1.0, -1.0, 1.0] * T)
        lo.extend([0.0] * T)
        hi.extend([np.inf] * T)
        r += T
    if nodes:
        for members in nodes:
            rr = r + np.arange(T)
            k = len(members)
            cc = [nx + ny + np.arange(T)]
            cc += [(l * E + i) * G + g for g in members] + [((l + 1) * E + j) * G + g for g in members]
            rows.extend(np.repeat(rr, 1 + 2 * k).tolist())
            cols.extend(np.stack(cc, 1).ravel().tolist())
            vals.extend(([1.0] + [-1.0] * k + [1.0] * k) * T)
            lo.extend([0.0] * T)
            hi.extend([np.inf] * T)
            r += T
    A = coo_matrix((vals, (rows, cols)), shape=(r, nvar)).tocsr()
    lb, ub = np.zeros(nvar), np.ones(nvar)
    ub[ns:] = np.inf
    lb[xi(0, 0, 0)] = 1.0  # symmetry breaking: expert 0 of the first MoE layer on rank 0
    integrality = np.zeros(nvar)
    integrality[:nx] = 1
    t0 = time.perf_counter()
    res = milp(c, constraints=LinearConstraint(A, lo, hi), integrality=integrality, bounds=Bounds(lb, ub),
               options={"time_limit": float(time_limit), "disp": False})
    info = {"status": int(res.status), "message": str(res.message), "seconds": time.perf_counter() - t0,
            "variables": nvar, "constraints": r, "mip_gap": getattr(res, "mip_gap", None)}
    if res.x is None:
        return None, info
    x = res.x[:nx].reshape(L, E, G)
    return x.argmax(-1).astype(np.int64), info


def greedy(C: np.ndarray, world_size: int, passes: int = 4) -> np.ndarray:
    """Heuristic: start contiguous, then repeatedly re-place each layer's experts by an optimal balanced
    assignment (``scipy.optimize.linear_sum_assignment`` over E/G slots per rank) given its neighbour layers."""
    from scipy.optimize import linear_sum_assignment

    L, E = _check_counts(C, world_size)
    G, per = world_size, E // world_size
    ranks = contiguous(L, E, G)
    slot_rank = np.repeat(np.arange(G), per)
    for _ in range(passes):
        for l in range(L):
            gain = np.zeros((E, G))  # transitions of expert e kept on-rank if e goes to rank g
            if l > 0:
                gain += np.stack([C[l - 1][ranks[l - 1] == g].sum(0) for g in range(G)], 1)
            if l < L - 1:
                gain += np.stack([C[l][:, ranks[l + 1] == g].sum(1) for g in range(G)], 1)
            _, col = linear_sum_assignment(-gain[:, slot_rank])
            ranks[l] = slot_rank[col]
    return ranks


def bisect(C: np.ndarray, world_size: int, time_limit: float | None = None, load_eps: float | None = 0.1
           ) -> tuple[np.ndarray, dict]:
    """Recursive halving for power-of-two ``world_size``: a G=2 ILP splits the experts of every layer into two
    halves of E/2, then each half (its sub-matrix of C) is split again. Rank ids follow the halves, so with
    ``ranks_per_node`` a power of two the first cuts are the node boundaries (the costliest hops are cut first).
    The time limit is shared: each of the ``G - 1`` two-way programs gets ``time_limit / (G - 1)``."""
    time_limit = _time_limit(time_limit)
    L, E = _check_counts(C, world_size)
    G = world_size
    if G & (G - 1):
        raise MoEError(f"bisect needs a power-of-two world_size, got {G}")
    info = {"subproblems": [], "status": "optimal"}

    def solve(sub: np.ndarray, experts: list[np.ndarray], g: int, base: int, out: np.ndarray) -> None:
        if g == 1:
            for l in range(L):
                out[l, experts[l]] = base
            return
        half, inf = ilp(sub, 2, time_limit=time_limit / max(1, G - 1), load_eps=load_eps)
        if half is None:
            half = greedy(sub, 2)
            inf["fallback"] = "greedy"
        else:
            gr = greedy(sub, 2)
            if objective(sub, gr) < objective(sub, half) - 1e-12 and _load_ok(sub, gr, 2, load_eps, half):
                half, inf["kept"] = gr, "greedy"
        if inf.get("status") not in (0, "trivial"):
            info["status"] = "time_limit_or_fallback"
        info["subproblems"].append({k: inf.get(k) for k in ("status", "seconds", "fallback", "kept")})
        for h in (0, 1):
            sel = [np.flatnonzero(half[l] == h) for l in range(L)]
            subc = np.stack([sub[l][np.ix_(sel[l], sel[l + 1])] for l in range(L - 1)])
            solve(subc, [experts[l][sel[l]] for l in range(L)], g // 2, base + h * (g // 2), out)

    out = np.zeros((L, E), dtype=np.int64)
    solve(np.asarray(C, float), [np.arange(E) for _ in range(L)], G, 0, out)
    return out, info


def _flat(C, G, time_limit, load_eps) -> tuple[np.ndarray, dict]:
    """Best single-level placement: bisect for power-of-two G >= 4, else the ILP (greedy kept when better
    and within the load bound, or when the ILP finds nothing)."""
    L, E = _check_counts(C, G)
    if G == 1:
        return np.zeros((L, E), dtype=np.int64), {"status": "trivial"}
    if G >= 4 and G & (G - 1) == 0:
        return bisect(C, G, time_limit, load_eps)
    ranks, info = ilp(C, G, time_limit=time_limit, load_eps=load_eps)
    gr = greedy(C, G)
    if ranks is None or (objective(C, gr) < objective(C, ranks) - 1e-12 and _load_ok(C, gr, G, load_eps, ranks)):
        ranks, info["kept"] = gr, "greedy"
    return ranks, info


def two_stage(C: np.ndarray, world_size: int, ranks_per_node: int, time_limit: float | None = None,
              load_eps: float | None = 0.1) -> tuple[np.ndarray, dict]:
    """ExFlow's two-stage solve: first split every layer's experts over the nodes (a ``G/ranks_per_node``-way
    placement of the whole problem, minimising inter-node transitions), then, inside each node, over its
    ``ranks_per_node`` GPUs (the node's sub-matrix of C). Rank ``g`` is on node ``g // ranks_per_node``. Half the
    time limit goes to the node stage, half is shared by the nodes."""
    time_limit = _time_limit(time_limit)
    L, E = _check_counts(C, world_size)
    G, rpn = world_size, ranks_per_node
    if rpn < 1 or G % rpn:
        raise MoEError(f"ranks_per_node={rpn} must divide world_size={G}")
    n_nodes = G // rpn
    C = np.asarray(C, float)
    nodes, info0 = _flat(C, n_nodes, time_limit / 2, load_eps)
    out = np.zeros((L, E), dtype=np.int64)
    info = {"node_stage": {k: info0.get(k) for k in ("status", "seconds", "kept")}, "gpu_stage": []}
    for nd in range(n_nodes):
        sel = [np.flatnonzero(nodes[l] == nd) for l in range(L)]
        sub = np.stack([C[l][np.ix_(sel[l], sel[l + 1])] for l in range(L - 1)])
        r, inf = _flat(sub, rpn, time_limit / 2 / n_nodes, load_eps)
        info["gpu_stage"].append({k: inf.get(k) for k in ("status", "seconds", "kept")})
        for l in range(L):
            out[l, sel[l]] = nd * rpn + r[l]
    info["status"] = "ok"
    return out, info


def place(C: np.ndarray, world_size: int, method: str = "auto", ranks_per_node: int | None = None,
          time_limit: float | None = None, gpu_cost: float = 1.0, node_cost: float = 2.0,
          seed: int = 0, load_eps: float | None = 0.1) -> PlacementResult:
    """Place experts from aggregated counts ``C [L-1, E, E]`` on ``world_size`` ranks.

    Args:
        time_limit: seconds for HiGHS (default ``HPDL_MOE_ILP_TIME_LIMIT``).
        method: "ilp" (direct program, with the node hop cost when ``ranks_per_node`` < world_size),
            "bisect" (recursive halving, power-of-two world sizes), "greedy", "contiguous", "random", or
            "two_stage" (nodes, then GPUs in each node; needs ``ranks_per_node``), or "auto" (two_stage when
            ``ranks_per_node`` < world_size, bisect for power-of-two G >= 4, else ilp); an ILP that finds
            nothing in ``time_limit`` seconds falls back to greedy, and greedy is kept when it is better and
            within the load bound.
        load_eps: token-load slack of the ILP (see :func:`ilp`); the result's ``details["load"]`` reports the
            busiest rank's share of each layer's routed tokens (:func:`load_share`).
    Raises:
        MoEError: world_size does not divide E, bad method or ranks_per_node.
    """
    time_limit = _time_limit(time_limit)
    L, E = _check_counts(C, world_size)
    G = world_size
    t0 = time.perf_counter()
    if method == "auto":
        pow2 = G & (G - 1) == 0
        if ranks_per_node and ranks_per_node < G:
            method = "two_stage"
        else:
            method = "bisect" if G >= 4 and pow2 else "ilp"
    details: dict = {}
    status = "ok"
    if method == "two_stage":
        if not ranks_per_node:
            raise MoEError("method='two_stage' needs ranks_per_node")
        ranks, details = two_stage(C, G, ranks_per_node, time_limit, load_eps)
    elif method == "contiguous":
        ranks = contiguous(L, E, G)
    elif method == "random":
        ranks = random_placement(L, E, G, seed)
    elif method == "greedy":
        ranks = greedy(C, G)
    elif method == "bisect":
        ranks, details = bisect(C, G, time_limit, load_eps)
        status = details["status"]
    elif method == "ilp":
        ranks, details = ilp(C, G, ranks_per_node, time_limit, gpu_cost, node_cost, load_eps)
        status = {0: "optimal", 1: "time_limit", "trivial": "optimal"}.get(details.get("status"), "failed")
        gr = greedy(C, G)
        if ranks is None:
            ranks, status = gr, "greedy_fallback"
        elif objective(C, gr, ranks_per_node, gpu_cost, node_cost) < \
                objective(C, ranks, ranks_per_node, gpu_cost, node_cost) - 1e-12 and \
                _load_ok(C, gr, G, load_eps, ranks):
            ranks, status = gr, status + "+greedy_better"
    else:
        raise MoEError(f"method must be auto, ilp, bisect, two_stage, greedy, contiguous or random; got {method!r}")
    ranks = validate(ranks, G)
    details["load"] = load_share(C, ranks)
    return PlacementResult(ranks, method, status, objective(C, ranks, ranks_per_node, gpu_cost, node_cost),
                           time.perf_counter() - t0, G, ranks_per_node, details)


def evaluate(C_test: np.ndarray, ranks: np.ndarray, world_size: int, n_random: int = 20, seed: int = 0) -> dict:
    """Held-out cross-GPU transition share of ``ranks`` against contiguous, random (mean of ``n_random``
    draws) and the random expectation ``1 - 1/G``."""
    L, E = _check_counts(C_test, world_size)
    rand = [cross_share(C_test, random_placement(L, E, world_size, seed + s)) for s in range(n_random)]
    ours = cross_share(C_test, ranks)
    return {"placement": ours, "contiguous": cross_share(C_test, contiguous(L, E, world_size)),
            "random_mean": float(np.mean(rand)), "random_std": float(np.std(rand)),
            "random_expected": 1 - 1 / world_size, "ratio_vs_random": ours / float(np.mean(rand))}
