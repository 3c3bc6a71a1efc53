import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _shutdown_rank_pools():
    yield
    from hpdl.testing import shutdown_pools

    shutdown_pools()
