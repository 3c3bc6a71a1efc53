"""Exceptions of hpdl.hpo; all derive from :class:`hpdl.runtime.errors.HpdlError`."""

from __future__ import annotations

from hpdl.runtime.errors import HpdlError


class HpoError(HpdlError):
    """Root of hpdl.hpo errors."""


class HpoConfigError(HpoError, ValueError):
    """A study file, search space, pool or policy option is invalid; the message names the field."""


class Preempted(HpoError):
    """Raised inside a trial when the driver asked it to stop and checkpoint (GPU removed or migration:
    ``stop=False``, the worker takes the next trial; the driver stops: ``stop=True``, the worker exits)."""

    def __init__(self, message: str, stop: bool = False):
        super().__init__(message)
        self.stop = stop


class HpoInterrupted(HpoError):
    """The driver was stopped by SIGINT or SIGTERM; its running trials were checkpointed and re-queued.
    ``exit_code`` is 128 + the signal number (130 for SIGINT, 143 for SIGTERM), as a shell reports it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum, self.exit_code = signum, 128 + signum
