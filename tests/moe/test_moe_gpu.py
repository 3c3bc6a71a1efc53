"""GPU checks of hpdl.moe's array functions (``pytest -m gpu``; skipped without CUDA)."""

import pytest
import torch

from hpdl.moe import dispatch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_plan_and_inverse_stay_on_the_device():
    # inverse() once built its arange on the host: a device mismatch on the first CUDA layer timing
    dest = torch.randint(0, 4, (1000,), device="cuda")
    p = dispatch.plan(dest, 4)
    x = torch.randn(1000, 8, device="cuda")
    inv = dispatch.inverse(p.order)
    assert inv.device == x.device and torch.equal(x[p.order][inv], x)
