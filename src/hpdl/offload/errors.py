"""Errors of hpdl.offload: invalid plans (at compile time, naming the operation), agent failures (naming the
agent), and failed or timed-out requests (naming the operations and peers still outstanding)."""

from __future__ import annotations

from hpdl.runtime.errors import CollectiveTimeoutError, HpdlError, PeerFailedError


class OffloadError(HpdlError):
    """Root of hpdl.offload's errors: a request failed while it ran (the message says which operation)."""


class PlanError(OffloadError, ValueError):
    """A plan is invalid: raised by :func:`hpdl.offload.compile` before anything runs.

    Attributes:
        op: name of the offending operation (None for plan-wide problems such as a bad buffer).
        rank: group rank whose plan holds it (None when not known, e.g. when checking one plan alone).
    """

    def __init__(self, message: str, *, op: str | None = None, rank: int | None = None):
        super().__init__(message)
        self.op, self.rank = op, rank


class AgentError(OffloadError):
    """A progress agent could not be started, reached, or died; the message and ``agent`` name it
    (node, pid and address), e.g. ``offload agent 0 (node 0, pid 4242, /tmp/hpdl-offload-ab12-0.sock)``."""

    def __init__(self, message: str, *, agent: str = ""):
        super().__init__(message)
        self.agent = agent


class OffloadTimeoutError(OffloadError, CollectiveTimeoutError):
    """``wait()`` ran past its timeout; the message lists the operations still outstanding and their peers,
    and ``missing_ranks`` the peers they wait for."""


class OffloadPeerError(OffloadError, PeerFailedError):
    """A peer rank's process died while a request needed it (on another node: its agent stopped with it);
    the message names the dead process, ``missing_ranks`` the plan's ranks whose messages were lost."""
