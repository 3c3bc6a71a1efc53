"""Grouped expert GEMMs: every local expert's SwiGLU over its rows in one call, no Python loop per expert and no
host sync (the row split lives in a device ``offs`` tensor).

Rows arrive sorted by local expert; ``offs [El]`` int32 holds the cumulative row ends (group ``g`` owns rows
``[offs[g-1], offs[g])``). Rows at or past ``offs[-1]`` are padding: their outputs are undefined and callers mask
them.

Backends:

* ``"grouped_mm"``: ``torch._grouped_mm`` (torch >= 2.9 on CPU; on CUDA only its SM90+ bf16 kernel, because the
  CUDA fallback for other dtypes/architectures reads ``offs`` on the host, i.e. syncs). Needs 16-byte aligned
  row strides.
* ``"bmm"``: a sync-free reference: every row times every local expert's matrix (``El`` times the FLOPs), then
  each row keeps its own group's result. Correct everywhere, for the cases above that the kernel refuses.

:func:`backend_for` picks one ("auto").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpdl.moe.errors import MoEError

BACKENDS = ("auto", "grouped_mm", "bmm")


def backend_for(device: torch.device, dtype: torch.dtype, dims: tuple[int, ...], backend: str = "auto") -> str:
    """The backend to use on ``device`` for ``dtype`` with inner dimensions ``dims`` (hidden, ffn, 2*ffn).

    Raises:
        MoEError: ``backend`` not in :data:`BACKENDS`, or "grouped_mm" forced where torch has no such op.
    """
    if backend not in BACKENDS:
        raise MoEError(f"grouped backend must be one of {BACKENDS}, got {backend!r}")
    have = hasattr(torch, "_grouped_mm")
    if backend == "grouped_mm" and not have:
        raise MoEError(f"grouped backend 'grouped_mm' needs torch._grouped_mm (torch >= 2.9), torch is "
                       f"{torch.__version__}")
    if backend != "auto":
        return backend
    esize = torch.empty(0, dtype=dtype).element_size()
    aligned = all(d * esize % 16 == 0 for d in dims)
    if not have or not aligned:
        return "bmm"
    if device.type == "cpu":
        return "grouped_mm"
    if device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0):
        return "grouped_mm"
    return "bmm"


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, backend: str) -> torch.Tensor:
    """``x [M, K]`` rows grouped by ``offs [El]`` (int32 cumulative ends), weights ``w [El, N, K]`` (nn.Linear
    layout) -> ``[M, N]`` with row ``i`` of group ``g`` equal to ``x[i] @ w[g].T``; rows >= ``offs[-1]`` undefined."""
    if backend == "grouped_mm":
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    M = x.shape[0]
    y = torch.matmul(x.unsqueeze(0), w.transpose(1, 2))  # [El, M, N]
    rows = torch.arange(M, device=x.device)
    g = torch.searchsorted(offs.long(), rows, right=True).clamp_max(w.shape[0] - 1)
    return y[g, rows]


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, offs: torch.Tensor,
           backend: str) -> torch.Tensor:
    """Grouped SwiGLU experts: ``x [M, H]`` sorted by group, ``w_gate_up [El, 2F, H]`` (gate rows first, as
    :class:`hpdl.models.gpt_moe.MoEBlock`), ``w_down [El, H, F]``, ``offs [El]`` int32 -> ``[M, H]``
    (``down(silu(gate(x)) * up(x))`` per row, rows past ``offs[-1]`` undefined)."""
    gu = grouped_linear(x, w_gate_up, offs, backend)
    gate, up = gu.chunk(2, dim=-1)
    return grouped_linear((F.silu(gate) * up).contiguous(), w_down, offs, backend)
