import pytest

from hpdl.testing import get_pool

import _hooks_cases as H


@pytest.mark.timeout(180)
@pytest.mark.parametrize("algorithm", ["direct", "auto"])
def test_ddp_hook_trains_like_ddp(algorithm):
    diffs = get_pool(3).run(H.ddp_steps, algorithm)
    # same averaged gradients up to float32 summation order (DDP's gloo ring vs hpdl's schedule)
    assert max(diffs) < 1e-5


@pytest.mark.timeout(180)
def test_ddp_hook_respects_ddp_subgroups():
    diffs = get_pool(4).run(H.ddp_steps, "auto", True)
    assert max(diffs) < 1e-5
