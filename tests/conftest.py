import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The fast tier (`pytest -m "not slow"`): tests that took at least the list's "seconds" in a measured run of the suite
# on 2 cores are marked slow here, as PyTorch's CI marks its slow tests from measured durations. Regenerate the
# list with `python3 tests/slow_tests.py DURATIONS.txt` (the output of `pytest --durations=0`).
_SLOW = json.loads((Path(__file__).parent / "slow_tests.json").read_text())["tests"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in _SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _shutdown_rank_pools():
    yield
    from hpdl.testing import shutdown_pools

    shutdown_pools()
