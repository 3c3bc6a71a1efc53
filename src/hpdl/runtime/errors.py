"""Exceptions shared by every hpdl subsystem."""

from __future__ import annotations


class HpdlError(RuntimeError):
    """Root of every error hpdl raises on purpose."""


class CollectiveTimeoutError(HpdlError, TimeoutError):
    """A distributed wait ran past its timeout; the message names the rank that did not answer."""

    def __init__(self, message: str, *, missing_ranks: list[int] | None = None):
        super().__init__(message)
        self.missing_ranks = list(missing_ranks or [])


class PeerFailedError(CollectiveTimeoutError):
    """A peer's process is gone (killed or crashed) or its connection broke; ``missing_ranks`` names it.

    A subclass of :class:`CollectiveTimeoutError`, so one ``except`` catches every peer failure.
    """


class CollectiveMismatchError(HpdlError, ValueError):
    """Ranks called the same collective with different counts, dtypes, ops or devices."""


class WorkerFailedError(HpdlError):
    """A spawned rank raised or died; the message carries its rank and traceback."""


class ProtocolError(WorkerFailedError):
    """A peer on a worker group's channel speaks another protocol version or sent an unknown message type (a stale
    rank, a different hpdl installation on the other side); the message names the sender and both versions."""


class CLIUsageError(ValueError):
    """Bad command-line usage: the ``hpdl`` command prints the sub-command's usage and this message, and exits
    with :attr:`exit_status` (1; the benchmark harness, :mod:`hpdl.bench.common`, gives the errors it finds before
    a run argparse's 2, so that 1 there means only "a row is wrong").

    Raised by library code that checks values a command line gave (it lives here, not in :mod:`hpdl.cli`, so
    that no library module imports the CLI)."""

    exit_status: int = 1
