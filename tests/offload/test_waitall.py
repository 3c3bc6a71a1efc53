"""hpdl.offload.waitall completes every request, as MPI_Waitall, also past one that fails."""

import pytest

import hpdl.offload as ho


class _Req:
    def __init__(self, error=None):
        self.error, self.waited = error, False

    def wait(self, timeout=None):
        self.waited = True
        if self.error is not None:
            raise self.error


def test_waitall_waits_for_every_request_and_raises_the_first_failure():
    reqs = [_Req(), _Req(ho.OffloadError("first")), _Req(), _Req(ho.OffloadTimeoutError("second")), _Req()]
    with pytest.raises(ho.OffloadError, match="first") as info:
        ho.waitall(reqs, timeout=5)
    assert all(r.waited for r in reqs)   # none left active behind the failed one
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert not hasattr(info.value, "add_note") or "request 1 of 5" in notes and "OffloadTimeoutError" in notes


def test_waitall_without_failures_returns():
    reqs = [_Req() for _ in range(3)]
    ho.waitall(reqs)
    assert all(r.waited for r in reqs)
