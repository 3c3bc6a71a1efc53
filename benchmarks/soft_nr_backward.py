"""Price of SOFT's Newton-Raphson backward modes: time of forward+backward and bytes saved for backward.

    PYTHONPATH=src python3 benchmarks/soft_nr_backward.py [--device cpu|cuda] [--reps 20]

exact: one more run of the iteration on [[A^T, G], [0, A^T]] (hpdl's default, exact for the truncated map);
inverse: the paper's -V^T G V^T (right only once converged); autograd: every step recorded.
Matrices: 32 landmark kernels (B*H) of m x m, 20 steps, float32. Saved bytes come from autograd's
saved-tensor hooks (exact, not a timing). Prints one line per (m, mode).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hpdl.models.soft_ops import gaussian_kernel, newton_pinv


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sizes", default="49,64,256")
    args = p.parse_args()
    dev = torch.device(args.device)
    torch.set_num_threads(1)
    print(f"# {torch.__version__} {dev}; 32 matrices, 20 steps, fp32; median of {args.reps}")
    print(f"{'m':>5} {'mode':>9} {'fwd+bwd ms':>11} {'saved KiB':>10} {'max |grad - exact|':>19}")
    for m in map(int, args.sizes.split(",")):
        x = torch.randn(32, m, 32, device=dev) * 32 ** -0.25
        a0 = gaussian_kernel(x, x)
        g = torch.randn_like(a0)
        ref = None
        for mode in ("exact", "inverse", "autograd"):
            a = a0.clone().requires_grad_()
            saved = []

            def pack(t):
                saved.append(t.numel() * t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                v = newton_pinv(a, 20, 0.01, 1.8, mode)
            (v * g).sum().backward()
            grad = a.grad.clone()
            ref = grad if mode == "exact" else ref
            times = []
            for _ in range(args.reps):
                a.grad = None
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                (newton_pinv(a, 20, 0.01, 1.8, mode) * g).sum().backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            print(f"{m:>5} {mode:>9} {statistics.median(times):>11.3f} {sum(saved) / 1024:>10.0f} "
                  f"{(grad - ref).abs().max().item():>19.2e}")


if __name__ == "__main__":
    main()
