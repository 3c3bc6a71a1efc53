"""Device timing helpers shared by ``hpdl bench attention``'s suites (vision/bench.py) and its goal run
(vision/soft_goal.py): CUDA-event medians with the peak memory of one more call, and the SDPA backend choice."""

from __future__ import annotations

import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device: torch.device, warmup: int = 2, reps: int = 5) -> dict:
    """Median / min milliseconds of ``fn()`` over ``reps`` calls after ``warmup``, and peak MiB above the
    allocation before one more call (CUDA; None on CPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    return {"ms": statistics.median(times), "ms_min": min(times), "peak_mib": peak}


def _free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sdpa_context(device, dtype):
    """Flash attention required on CUDA with 16-bit inputs (so 'sdpa' means flash there), the default elsewhere."""
    import contextlib

    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # a factory: sdpa_kernel's context manager is generator-based and can be entered only once
        return (lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])), "flash"
    return contextlib.nullcontext, "default"
