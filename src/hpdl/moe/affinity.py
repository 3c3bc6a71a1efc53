"""Inter-layer expert affinity (ExFlow, arXiv 2401.08383, section 3): pure functions of routing arrays.

``C[l, i, j]`` counts tokens that use expert ``i`` at MoE layer ``l`` and expert ``j`` at layer ``l+1``; with top-k
routing each token contributes all ``k x k`` slot pairs with weight ``1/k^2``, so every token weighs 1 per
transition. From C: the conditional ``P(j at l+1 | i at l)``, its load-weighted mean maximum (ExFlow's summary,
uniform routing gives ``1/E``) and the mutual information between consecutive layers' choices. A baseline that
shuffles tokens independently per layer keeps every layer's expert loads but breaks the token link, so it shows
how much of the statistic is load skew and finite-sample bias rather than affinity.
"""

from __future__ import annotations

import numpy as np

from hpdl.moe.errors import MoEError


def transition_counts(experts: np.ndarray, n_experts: int) -> np.ndarray:
    """``experts [N, L, k]`` int -> ``C [L-1, E, E]`` float64 (each token adds 1 per transition, split 1/k^2)."""
    e = np.asarray(experts)
    if e.ndim == 2:
        e = e[:, :, None]
    if e.ndim != 3 or e.shape[1] < 2:
        raise MoEError(f"experts must be [tokens, layers >= 2, k], got shape {e.shape}")
    if e.size and (e.min() < 0 or e.max() >= n_experts):
        raise MoEError(f"expert ids must be in [0, n_experts={n_experts}), got range [{e.min()}, {e.max()}]")
    N, L, k = e.shape
    E = n_experts
    C = np.zeros((L - 1, E, E))
    for l in range(L - 1):
        for a in range(k):
            for b in range(k):
                C[l] += np.bincount(e[:, l, a].astype(np.int64) * E + e[:, l + 1, b], minlength=E * E).reshape(E, E)
    return C / (k * k)


def conditional(C: np.ndarray) -> np.ndarray:
    """Row-normalised ``P[l, i, j] = C[l, i, j] / sum_j C[l, i, j]`` (rows of unused experts are 0)."""
    rows = C.sum(-1, keepdims=True)
    return np.divide(C, rows, out=np.zeros_like(C, dtype=float), where=rows > 0)


def mean_max_conditional(C: np.ndarray) -> np.ndarray:
    """Per transition ``[L-1]``: ``sum_i (n_i / N) max_j P(j | i) = sum_i max_j C[i, j] / sum C``."""
    tot = C.sum((-1, -2))
    return np.divide(C.max(-1).sum(-1), tot, out=np.zeros_like(tot), where=tot > 0)


def mutual_information(C: np.ndarray) -> np.ndarray:
    """Per transition ``[L-1]``: mutual information (bits) between the expert at layer l and at l+1."""
    tot = C.sum((-1, -2), keepdims=True)
    P = np.divide(C, tot, out=np.zeros_like(C, dtype=float), where=tot > 0)
    pi, pj = P.sum(-1, keepdims=True), P.sum(-2, keepdims=True)
    denom = pi * pj
    ratio = np.divide(P, denom, out=np.ones_like(P), where=(P > 0) & (denom > 0))
    return (P * np.log2(ratio)).sum((-1, -2))


def shuffled(experts: np.ndarray, seed: int = 0) -> np.ndarray:
    """Copy of ``experts [N, L, k]`` whose tokens are permuted independently at every layer (same loads)."""
    rng = np.random.default_rng(seed)
    e = np.array(experts, copy=True)
    for l in range(e.shape[1]):
        e[:, l] = e[rng.permutation(len(e)), l]
    return e


def summary(experts: np.ndarray, n_experts: int, seed: int = 0) -> dict:
    """Affinity of a trace against its shuffled-token baseline and uniform routing.

    Returns plain lists/floats: ``mean_max_conditional`` and ``mutual_information_bits`` per transition for the
    trace and for the shuffled baseline, their means, and ``uniform = 1/E``.
    """
    if len(experts) == 0:
        raise MoEError("experts holds no token: affinity of an empty trace is undefined")
    C = transition_counts(experts, n_experts)
    Cs = transition_counts(shuffled(experts, seed), n_experts)
    mmc, mmc_s = mean_max_conditional(C), mean_max_conditional(Cs)
    mi, mi_s = mutual_information(C), mutual_information(Cs)
    return {"n_tokens": int(len(experts)), "n_experts": n_experts, "uniform": 1.0 / n_experts,
            "mean_max_conditional": mmc.tolist(), "shuffled_mean_max_conditional": mmc_s.tolist(),
            "mutual_information_bits": mi.tolist(), "shuffled_mutual_information_bits": mi_s.tolist(),
            "mean": {"mean_max_conditional": float(mmc.mean()), "shuffled_mean_max_conditional": float(mmc_s.mean()),
                     "mutual_information_bits": float(mi.mean()),
                     "shuffled_mutual_information_bits": float(mi_s.mean())}}


def plot_heatmaps(C: np.ndarray, path, title: str = "") -> None:
    """Heat maps of ``P(j at l+1 | i at l)`` for every transition, one panel each, saved to ``path`` (PNG)."""
    from hpdl.bench.common import pyplot

    plt = pyplot()

    P = conditional(C)
    n = len(P)
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for t, ax in enumerate(axes.flat):
        if t >= n:
            ax.axis("off")
            continue
        im = ax.imshow(P[t], vmin=0, vmax=1, cmap="viridis")
        ax.set_title(f"MoE layer {t} -> {t + 1}", fontsize=9)
        ax.set_xlabel("expert at l+1")
        ax.set_ylabel("expert at l")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="P(j | i)")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
