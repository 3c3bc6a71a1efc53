"""Every hpdl exception with its own constructor survives pickling (a spawned rank's or a worker process's
error crosses a process boundary through multiprocessing, which pickles it; a constructor with more than the
message made the receiving side fail with an unrelated TypeError)."""

import pickle

import pytest

from hpdl.bench.report import NoisySweepError
from hpdl.runtime.errors import CLIUsageError, CollectiveTimeoutError, PeerFailedError
from hpdl.serve.sampling import InvalidParamError
from hpdl.serve.serving import APIError


@pytest.mark.parametrize("exc, attrs", [
    (InvalidParamError("top_p", "top_p must be in (0, 1]"), {"param": "top_p"}),
    (APIError(400, "bad request", "top_p"), {"status": 400, "message": "bad request", "param": "top_p"}),
    (NoisySweepError("too noisy", [1, 2]), {"rows": [1, 2]}),
    (PeerFailedError("rank 1 died", missing_ranks=[1]), {"missing_ranks": [1]}),
    (CollectiveTimeoutError("late"), {"missing_ranks": []}),
    (CLIUsageError("--x: bad"), {}),
])
def test_exception_round_trips_through_pickle(exc, attrs):
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    for k, v in attrs.items():
        assert getattr(back, k) == v
