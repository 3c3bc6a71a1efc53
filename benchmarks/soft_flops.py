"""Where SOFT-Tiny's model-level time goes: FLOPs of forward+backward (batch 16) counted by
torch.utils.flop_counter on the meta device (no compute: seconds on a CPU), with 20 and with 0 Newton steps (the
difference is the Newton-Raphson inverse, forward and exact backward), with the paper's backward, and for the
twin with softmax SDPA. The Newton part runs in float32 (no tensor cores on a GPU); the rest runs in bf16 under
autocast on a GPU.

    PYTHONPATH=src python3 benchmarks/soft_flops.py
"""

import contextlib

import torch
from torch.utils.flop_counter import FlopCounterMode

from hpdl.models.soft import create


def tflop(size: int, batch: int = 16, **overrides) -> float:
    with torch.device("meta"):
        model = create("soft_tiny", **overrides)
        x = torch.randn(batch, 3, size, size)
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).float().logsumexp(-1).mean().backward()
    return counter.get_total_flops() / 1e12


def main() -> None:
    torch.autocast = lambda *a, **k: contextlib.nullcontext()   # no autocast on meta; FLOPs do not depend on it
    for size in (224, 512, 768):
        soft, no_nr = tflop(size, nr_backward="exact"), tflop(size, nr_iters=0)
        sdpa = tflop(size, attention="sdpa")
        inverse = tflop(size, nr_backward="inverse")
        print(f"{size}px batch16 fwd+bwd TFLOP: soft {soft:.2f}  of which NR (20 iters, exact bwd) {soft - no_nr:.2f}"
              f"  with paper backward NR {inverse - no_nr:.2f}   sdpa twin {sdpa:.2f}")


if __name__ == "__main__":
    main()
