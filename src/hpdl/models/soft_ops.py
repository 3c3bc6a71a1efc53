"""SOFT's numerical core: Gaussian-kernel attention through landmarks, and a Newton-Raphson Moore-Penrose inverse.

Lu et al., "SOFT: Softmax-free Transformer with Linear Complexity", NeurIPS 2021 (arXiv 2110.11945), and
"Softmax-free Linear Transformers", IJCV 2024 (arXiv 2207.03341; SOFT++, symmetric normalisation); official code
github.com/fudan-zvg/SOFT (``SOFT/kernel/inverse.py``, ``models/softmax_free_transformer.py``).

With queries ``q`` (already scaled by ``d**-0.25``, keys tied to queries) and ``m`` landmarks ``l``:

    P = exp(-||q_i - l_j||^2 / 2)   [N, m]      A = exp(-||l_i - l_j||^2 / 2)   [m, m]
    out = P @ NR(A + reg*I) @ (P^T @ v)         (evaluated right to left: O(N*m*d), linear in N for fixed m)

``NR`` is the Newton-Raphson (Newton-Schulz) iteration ``V <- 2V - V A V``. From the official ``V0 = alpha*A`` an
eigenvalue mu of a symmetric A maps after k steps to ``(1 - (1 - alpha*mu^2)^(2^k)) / mu``, which tends to 1/mu (0
for mu = 0, so the limit is the Moore-Penrose inverse); from ``V0 = I/(s + reg)`` (hpdl's default for SOFT's SPD
``A + reg*I``) to ``(1 - (1 - mu/(s+reg))^(2^k)) / mu``: the condition number enters linearly, not squared.
Everything here runs in float32 whatever the autocast dtype: the kernel's ``|q|^2 + |l|^2 - 2 q.l`` cancels badly
in bf16/fp16, and fp16 floors the NR residual near 2e-4. On CUDA the products run in the Triton kernels of
:mod:`hpdl.models.soft_kernels` (centred inputs, TF32 tensor cores, no ``[N, m]`` tensor stored).

Also here: :func:`nystrom_attention` (Xiong et al., AAAI 2021, arXiv 2102.03902), the softmax Nystrom baseline of
``hpdl bench attention``, written as Hugging Face's ``NystromformerSelfAttention`` computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpdl.models import soft_kernels

__all__ = ["IMPLS", "NR_BACKWARDS", "NR_STARTS", "gaussian_kernel", "newton_pinv", "norm_alpha_scale",
           "nystrom_attention",
           "soft_attention"]

NR_BACKWARDS = ("inverse", "exact", "autograd")


def gaussian_kernel(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``exp(-||x_i - y_j||^2 / 2)`` for ``x [..., N, d]``, ``y [..., M, d]`` -> ``[..., N, M]``, in x's dtype.

    One matmul of ``[x, -|x|^2/2, -1/2]`` by ``[y, 1, |y|^2]`` gives the exponent, so the ``[N, M]`` matrix is
    written twice (matmul, exp in place) instead of four times. Call it in float32 (see module docstring).
    """
    x2 = x.pow(2).sum(-1, keepdim=True)
    y2 = y.pow(2).sum(-1, keepdim=True)
    xa = torch.cat([x, -0.5 * x2, torch.full_like(x2, -0.5)], dim=-1)
    ya = torch.cat([y, torch.ones_like(y2), y2], dim=-1)
    return torch.matmul(xa, ya.transpose(-1, -2)).exp_()


def _start(a: torch.Tensor, alpha: torch.Tensor, start: str) -> torch.Tensor:
    """V0: ``alpha * a`` (official) or ``alpha * I`` (identity); a [B, n, n], alpha [B, 1, 1]."""
    if start == "identity":
        return alpha * torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
    return alpha * a


def _nr_loop(a: torch.Tensor, alpha: torch.Tensor, iters: int, start: str = "official") -> torch.Tensor:
    """``iters`` steps of V <- 2V - (V a) V from V0 (:func:`_start`); a [..., n, n], alpha [...]."""
    shape = a.shape
    a3 = a.reshape(-1, shape[-2], shape[-1])
    v = _start(a3, alpha.reshape(-1, 1, 1), start)
    for _ in range(iters):
        v = torch.baddbmm(v, torch.bmm(v, a3), v, beta=2.0, alpha=-1.0)
    return v.reshape(shape)


def _frechet_loop(b: torch.Tensor, e: torch.Tensor, alpha: torch.Tensor, iters: int,
                  start: str = "official") -> torch.Tensor:
    """Top-right block of ``iters`` Newton steps on ``[[b, e], [0, b]]`` (from ``alpha`` times it), without forming
    the 2n x 2n matrix: with the iterate ``[[X, Y], [0, X]]`` and ``W = X b = b X`` (X is a polynomial in b),
    ``Y <- 2Y - (W Y + Y W + X e X)`` and ``X <- 2X - W X``: six n x n products a step instead of 16. The start
    ``alpha * I`` has no e term (Y0 = 0)."""
    shape = b.shape
    b3, e3 = b.reshape(-1, shape[-2], shape[-1]), e.reshape(-1, shape[-2], shape[-1])
    a3 = alpha.reshape(-1, 1, 1)
    x, y = _start(b3, a3, start), (torch.zeros_like(e3) if start == "identity" else a3 * e3)
    for _ in range(iters):
        w = torch.bmm(x, b3)
        t = torch.bmm(torch.bmm(x, e3), x)
        t = torch.baddbmm(torch.baddbmm(t, w, y), y, w)
        y = torch.sub(2 * y, t)
        x = torch.baddbmm(x, w, x, beta=2.0, alpha=-1.0)
    return y.reshape(shape)


def _frechet_loop_symmetric(b: torch.Tensor, e: torch.Tensor, alpha: torch.Tensor, iters: int,
                            start: str = "official") -> torch.Tensor:
    """:func:`_frechet_loop` for symmetric ``b`` and ``e``: then every ``Y`` is symmetric and ``Y W = (W Y)^T``,
    so ``W Y + Y W`` is one product and its transpose: five n x n products a step instead of six."""
    shape = b.shape
    b3, e3 = b.reshape(-1, shape[-2], shape[-1]), e.reshape(-1, shape[-2], shape[-1])
    a3 = alpha.reshape(-1, 1, 1)
    x, y = _start(b3, a3, start), (torch.zeros_like(e3) if start == "identity" else a3 * e3)
    for _ in range(iters):
        w = torch.bmm(x, b3)
        wy = torch.bmm(w, y)
        t = torch.baddbmm(wy + wy.transpose(-1, -2), torch.bmm(x, e3), x)
        y = torch.sub(2 * y, t)
        x = torch.baddbmm(x, w, x, beta=2.0, alpha=-1.0)
    return y.reshape(shape)


def _alpha(a: torch.Tensor, scale: torch.Tensor, reg: float = 0.0, start: str = "official"
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """alpha = scale / s^2 (official) or 1 / (s + reg) (identity) with s the largest row sum of each matrix (it
    bounds the spectral radius if a >= 0); returns (alpha, the divisor of dL/ds's formula, the row of s)."""
    s, row = a.sum(-1).max(-1)
    if start == "identity":
        return 1.0 / (s + reg), s + reg, row
    return scale / (s * s), s, row


class _NewtonPinv(torch.autograd.Function):
    """Forward: the truncated iteration, no graph. Backward: the paper's ``-V^T G V^T`` ("inverse", the default:
    the derivative of the exact inverse, 2 products) or ("exact") the derivative of that truncated map.

    Exact: every iterate is a polynomial p(A_r) of A_r = A + reg*I, and for any E the block matrix
    ``p([[A_r^T, E], [0, A_r^T]])`` holds the Frechet derivative L_p(A_r^T, E) top right; its adjoint is the
    gradient, so the backward is one more run of the same iteration on ``[[A_r^T, G], [0, A_r^T]]`` (same alpha;
    :func:`_frechet_loop`): exact whether or not the iteration converged, O(n^2) memory whatever the step count.
    alpha depends on A too: with t = sqrt(alpha) (official start) or t = alpha (identity start), the iterate is
    t N(t A_r) and dL/ds = -(<G, V> + <L_p(A_r^T, G), A_r>)/s' (s' = s, resp. s + reg), which flows to the row of A
    whose sum is s.
    """

    @staticmethod
    def forward(ctx, a, scale, iters, reg, backward, symmetric=False, start="official", kernels=False,
                precision=None, tol=soft_kernels.NR_TOL):
        alpha, s, row = _alpha(a, scale, reg, start)
        if kernels:  # Triton: fused on chip (small m) or TF32 steps + float32 ones; same start, same alpha
            shape = a.shape
            v = soft_kernels.newton_inverse(a.reshape(-1, shape[-2], shape[-1]).contiguous(), iters, reg, scale,
                                            start, precision, tol=tol).reshape(shape)
        else:
            eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
            v = _nr_loop(a + reg * eye if reg else a, alpha, iters, start)
        ctx.iters, ctx.backward, ctx.symmetric, ctx.start, ctx.reg, ctx.kernels = (iters, backward, symmetric,
                                                                                   start, reg, kernels)
        ctx.save_for_backward(a, v, alpha, s, row)
        return v

    @staticmethod
    def backward(ctx, g):
        a, v, alpha, s, row = ctx.saved_tensors
        none = (None,) * 9
        if ctx.backward == "inverse":  # the paper's: d(A^-1) for an exact inverse (ignores truncation and alpha)
            n = v.shape[-1]
            if ctx.kernels and n > soft_kernels.FUSED_MAX_M:   # 3xTF32 tensor cores for large landmark counts
                shape = v.shape
                return (soft_kernels.neg_vgv(v.reshape(-1, n, n), g.reshape(-1, n, n)).reshape(shape),) + none
            vt = v.transpose(-1, -2)
            return (-(vt @ g @ vt),) + none
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        a_r = a + ctx.reg * eye if ctx.reg else a
        if ctx.symmetric:   # only the symmetric part of the gradient of a symmetric A reaches its inputs
            y = _frechet_loop_symmetric(a_r, 0.5 * (g + g.transpose(-1, -2)), alpha, ctx.iters, ctx.start)
        else:
            y = _frechet_loop(a_r.transpose(-1, -2), g, alpha, ctx.iters, ctx.start)
        dl_ds = -((g * v).sum((-1, -2)) + (y * a_r).sum((-1, -2))) / s
        n = a_r.shape[-1]
        grad = y
        grad.scatter_add_(-2, row[..., None, None].expand(*row.shape, 1, n),
                          dl_ds[..., None, None].expand(*row.shape, 1, n))
        return (grad,) + none


NR_STARTS = ("official", "identity")
IMPLS = ("auto", "torch", "triton")


def _use_kernels(impl: str, t: torch.Tensor) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch" or t.dtype != torch.float32:
        return False
    if impl == "triton" and not soft_kernels.available(t):
        raise ValueError(f"impl='triton' needs a CUDA tensor (or TRITON_INTERPRET=1), got device {t.device}")
    return soft_kernels.available(t)


def newton_pinv(a: torch.Tensor, iters: int = 20, reg: float = 0.01, scale: float | torch.Tensor = 1.8,
                backward: str = "inverse", symmetric: bool = False, start: str = "official",
                impl: str = "torch", precision: str | None = None, tol: float = soft_kernels.NR_TOL) -> torch.Tensor:
    """Newton-Raphson approximation of the Moore-Penrose inverse of ``a + reg*I``, SOFT's initialisation.

    Args:
        a: ``[..., n, n]`` matrices (SOFT: the landmark Gaussian kernel, symmetric positive semi-definite with
            non-negative entries, so its largest row sum bounds its spectral radius). float32 or float64.
        iters: Newton steps; SOFT uses 20 (``newton_maxiter`` in every official config), which converges for
            condition numbers up to about 1e2 (k ~ 2 log2(cond) + log2(ln(1/eps)/1.8) steps are needed from the
            official start, about log2(cond) + log2(ln(1/eps)) from the identity start).
        reg: ``reg*I`` is added before inverting (SOFT: 0.01; SOFT++: 0). alpha uses the row sums of ``a``.
        scale: official start: ``alpha = scale / (max row sum of a)^2`` per matrix (SOFT: 0.9*2 = 1.8). A tensor
            ``[...]`` gives one scale per matrix (SOFT++'s backtracking, :func:`norm_alpha_scale`).
        backward: ``"inverse"`` (default) is the paper's ``-V^T G V^T``, the derivative of the exact inverse (off
            where the iteration has not converged); ``"exact"`` differentiates the truncated iteration exactly (see
            ``_NewtonPinv``) at about 2.5 forwards' cost; ``"autograd"`` records all steps (memory grows with
            ``iters``).
        symmetric: ``a`` is a symmetric function of its inputs (SOFT's landmark kernel): the exact backward then
            returns the symmetric part of the gradient (plus alpha's term), all that reaches those inputs, with 5
            products a Newton step instead of 6. Not for a general ``a``: its antisymmetric gradient is dropped.
        start: ``"official"`` (``V0 = alpha (a + reg I)``, the paper's) or ``"identity"`` (``V0 = I / (s + reg)``:
            for the SPD ``a + reg*I`` (needs reg > 0) the residual ``I - V0 A_r`` has eigenvalues
            ``1 - mu / (s + reg)`` instead of ``1 - alpha mu^2``, so the condition number enters linearly and
            the same steps leave a far smaller residual).
        impl: ``"torch"`` (default), ``"triton"`` (:mod:`hpdl.models.soft_kernels`, float32 only; raises off
            CUDA unless TRITON_INTERPRET=1) or ``"auto"`` (Triton where it can run on float32, else torch).
        precision: Triton products for n > 64 (see ``soft_kernels.newton_inverse``): None (``"tf32x3"``),
            ``"tf32"`` (fast; condition numbers up to ~1e2 only) or ``"ieee"``.
        tol: Triton only: each matrix stops once a step's residual ``||I - V A_r||_F^2 <= tol`` or stalls at the
            rounding floor (``soft_kernels.newton_inverse``); 0 runs every step. The torch path always runs all.

    Returns:
        ``[..., n, n]`` in a's dtype: the iterate ``V_iters``; each matrix of the batch is handled alone.

    Raises:
        ValueError: a is not a batch of square matrices, iters < 0, reg or tol < 0 or NaN, backward/start/impl
            unknown, or the identity start without reg > 0 (its iterate would double on a null space).
    """
    if a.dim() < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"a must be [..., n, n], got shape {tuple(a.shape)}")
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    if not reg >= 0:   # NaN too
        raise ValueError(f"reg must be >= 0, got {reg}")
    if not tol >= 0:   # checked on every path, not only the Triton one that uses it
        raise ValueError(f"tol must be >= 0, got {tol}")
    if backward not in NR_BACKWARDS:
        raise ValueError(f"backward must be one of {NR_BACKWARDS}, got {backward!r}")
    if start not in NR_STARTS:
        raise ValueError(f"start must be one of {NR_STARTS}, got {start!r}")
    if start == "identity" and not reg > 0:
        raise ValueError(f"start='identity' needs reg > 0 (a + reg*I positive definite), got reg={reg}")
    kernels = _use_kernels(impl, a)
    if kernels and (not isinstance(scale, (int, float)) or backward == "autograd"):
        kernels = False  # per-matrix scales (SOFT++) and recorded steps stay in torch
    if kernels:  # a python float: the kernel takes it as an argument
        return _NewtonPinv.apply(a, float(scale), iters, reg, backward, symmetric, start, kernels, precision,
                                 float(tol))
    scale_t = torch.as_tensor(scale, dtype=a.dtype, device=a.device).expand(a.shape[:-2])
    if backward == "autograd":
        a_r = a + reg * torch.eye(a.shape[-1], dtype=a.dtype, device=a.device) if reg else a
        alpha, _, _ = _alpha(a, scale_t, reg, start)
        return _nr_loop(a_r, alpha, iters, start)
    return _NewtonPinv.apply(a, scale_t, iters, reg, backward, symmetric, start, kernels)


def norm_alpha_scale(a: torch.Tensor, halvings: int = 10, tol: float = 1.01) -> torch.Tensor:
    """SOFT++'s initial scale: 2 * 0.5^j with j the fewest halvings (at most ``halvings``) giving
    ``||I - alpha a^2||_1 <= tol`` for alpha = scale / (max row sum)^2 (official ``newton_inv`` of
    ``SoftmaxFreeNormAttentionKernel``), chosen per matrix and without host synchronisation (the official loop
    takes one alpha for the whole batch and syncs each halving). Returns ``[...]``, treated as a constant."""
    with torch.no_grad():
        a2 = a @ a
        s = a.sum(-1).amax(-1)
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        scale = torch.full_like(s, 2.0 * 0.5 ** halvings)
        for j in range(halvings - 1, -1, -1):  # the smallest passing j wins
            c = 2.0 * 0.5 ** j
            ok = (eye - (c / (s * s))[..., None, None] * a2).abs().sum(-2).amax(-1) <= tol
            scale = torch.where(ok, torch.full_like(s, c), scale)
    return scale


def soft_attention(q: torch.Tensor, v: torch.Tensor, landmarks: torch.Tensor, *, variant: str = "soft",
                   iters: int = 20, reg: float = 0.01, backward: str = "inverse", start: str | None = None,
                   impl: str = "auto", precision: str = "tf32", nr_precision: str | None = None,
                   nr_tol: float = soft_kernels.NR_TOL) -> torch.Tensor:
    """SOFT attention through landmarks: ``P @ NR(A) @ (P^T @ v)``, linear in N for a fixed landmark count.

    Args:
        q: ``[B, H, N, d]`` queries = keys, already scaled by ``d**-0.25`` (so the kernel is
            ``exp(-||q_i - q_j||^2 / (2 sqrt(d)))`` of the unscaled ones).
        v: ``[B, H, N, dv]`` values.
        landmarks: ``[B, H, m, d]`` (strided conv or pooling of q; ``m = N`` with ``landmarks = q``, ``reg = 0``
            and a well-conditioned kernel gives the exact Gaussian-kernel attention ``S @ v``).
        variant: ``"soft"`` (SOFT: inverse of A + reg*I) or ``"norm"`` (SOFT++: reg = 0, backtracked alpha,
            inverse replaced by ``D^-1/2 NR(A) D^-1/2`` with D the row sums of A, as the official
            ``SoftmaxFreeNormAttentionKernel``).
        iters, reg, backward: see :func:`newton_pinv` (reg is ignored by ``"norm"``; backward default: the
            paper's ``"inverse"``).
        start: Newton start, see :func:`newton_pinv`; None: ``"identity"`` for ``"soft"`` with reg > 0,
            ``"official"`` otherwise (SOFT++ inverts a singular-capable A and keeps the official start).
        impl: ``"auto"`` (default: the Triton kernels of :mod:`hpdl.models.soft_kernels` on CUDA, torch
            elsewhere), ``"torch"`` or ``"triton"``. The Triton path never stores the ``[N, m]`` matrix P: tiles
            are recomputed in two passes (``Z = P^T v``, then ``out = P (NR(A) Z)``) forward and backward.
        precision: Triton landmark products, ``"tf32"`` (default), ``"tf32x3"`` (about float32) or ``"ieee"``.
        nr_precision: Triton Newton products above 64 landmarks (:func:`newton_pinv`'s ``precision``).
        nr_tol: Triton Newton early exit (:func:`newton_pinv`'s ``tol``; 0: all ``iters`` steps).

    Returns:
        ``[B, H, N, dv]`` in v's dtype. The kernel, the inverse and the products run in float32 (TF32 tensor
        cores in the Triton path) with autocast off; float64 inputs run in float64 on torch.

    Raises:
        ValueError: shapes disagree, no landmarks, nr_tol < 0 or NaN, variant/start/impl/precision unknown.
    """
    if variant not in ("soft", "norm"):
        raise ValueError(f"variant must be 'soft' or 'norm', got {variant!r}")
    if q.dim() != 4 or q.shape[:-2] != v.shape[:-2] or q.shape[-2] != v.shape[-2] \
            or landmarks.shape[:-2] != q.shape[:-2] or landmarks.shape[-1] != q.shape[-1]:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, v {tuple(v.shape)}, landmarks {tuple(landmarks.shape)}")
    if landmarks.shape[-2] < 1:
        raise ValueError(f"landmarks must hold at least one landmark (m >= 1), got {tuple(landmarks.shape)}")
    if not nr_tol >= 0:   # checked on every path: a value the torch path ignores must not fail only on CUDA
        raise ValueError(f"nr_tol must be >= 0, got {nr_tol}")
    if start is None:
        start = "identity" if variant == "soft" and reg > 0 else "official"
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.autocast(q.device.type, enabled=False):
        lf = landmarks.to(dtype)
        kernels = _use_kernels(impl, lf)
        if kernels and variant == "soft" and backward == "inverse":
            # the default on CUDA: one autograd node for the kernel, the inverse and both products
            sk = soft_kernels
            b, h, n, dh = q.shape
            m = lf.shape[-2]
            # q centred inside soft_core (its float32 copy written once from q's own layout, its gradient
            # returned in q's dtype); the landmarks' centre is a constant (distances do not depend on it)
            l3 = lf.reshape(b * h, m, dh)
            c = l3.detach().mean(-2, keepdim=True)
            out = sk.soft_core(q.reshape(b * h, n, dh), l3 - c, v.reshape(b * h, n, -1), iters=iters, reg=reg,
                               start=start, precision=precision, nr_precision=nr_precision, tol=nr_tol, centre=c)
            return out.view(b, h, n, -1).to(v.dtype)
        a = gaussian_kernel(lf, lf)  # [B, H, m, m]
        if variant == "soft":
            inv = newton_pinv(a, iters, reg, 1.8, backward, symmetric=True, start=start, impl=impl,
                              precision=nr_precision, tol=nr_tol)
        else:
            d = a.sum(-1).rsqrt()
            inv = newton_pinv(a, iters, 0.0, norm_alpha_scale(a), backward, symmetric=True, start=start)
            inv = d[..., :, None] * inv * d[..., None, :]
        if kernels:
            sk = soft_kernels
            b, h, n, dh = q.shape
            m = lf.shape[-2]
            # centred float32 q and l (one copy, shared by both products); v stays in its own dtype
            q3, l3 = sk.centre(q.reshape(b * h, n, dh), landmarks.reshape(b * h, m, dh))
            v3 = v.reshape(b * h, n, -1)
            z = sk.landmark_pt(q3, l3, v3, precision=precision)                     # [BH, m, dv]
            w = torch.bmm(inv.reshape(b * h, m, m), z)                              # [BH, m, dv]
            out = sk.landmark_p(q3, l3, w, precision=precision).view(b, h, n, -1)   # [B, H, N, dv]
        else:
            qf, vf = q.to(dtype), v.to(dtype)
            p = gaussian_kernel(qf, lf)  # [B, H, N, m]
            out = p @ (inv @ (p.transpose(-1, -2) @ vf))
    return out.to(v.dtype)


def nystrom_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_landmarks: int = 64,
                      iters: int = 6) -> torch.Tensor:
    """Nystromformer softmax attention (Xiong et al. 2021) as Hugging Face's ``NystromformerSelfAttention``.

    Landmarks are segment means of ``num_landmarks`` equal segments (N must be a multiple); the 3rd-order
    iteration ``Z <- Z (13I - KZ(15I - KZ(7I - KZ))) / 4`` runs ``iters`` times from ``K^T / ||K||_1`` taken per
    matrix (HF's default, "original", takes the largest column sum over the whole batch; the two agree for one
    matrix). ``q, k, v [B, H, N, d]`` unscaled; returns ``[B, H, N, d]``. Raises ValueError if N % m != 0.
    """
    b, h, n, d = q.shape
    if n % num_landmarks:
        raise ValueError(f"tokens ({n}) must be a multiple of num_landmarks ({num_landmarks})")
    q = q * d ** -0.25
    k = k * d ** -0.25
    ql = q.reshape(b, h, num_landmarks, n // num_landmarks, d).mean(-2)
    kl = k.reshape(b, h, num_landmarks, n // num_landmarks, d).mean(-2)
    k1 = F.softmax(q @ kl.transpose(-1, -2), dim=-1)
    k2 = F.softmax(ql @ kl.transpose(-1, -2), dim=-1)
    k3 = F.softmax(ql @ k.transpose(-1, -2), dim=-1)
    eye = torch.eye(num_landmarks, dtype=k2.dtype, device=k2.device)
    z = k2.transpose(-1, -2) / k2.sum(-2).amax(-1)[..., None, None]
    for _ in range(iters):
        kz = k2 @ z
        z = (0.25 * z) @ (13 * eye - kz @ (15 * eye - kz @ (7 * eye - kz)))
    return (k1 @ z) @ (k3 @ v)
