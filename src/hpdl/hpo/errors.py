"""Exceptions of hpdl.hpo; all derive from :class:`hpdl.runtime.errors.HpdlError`."""

from __future__ import annotations

from hpdl.runtime.errors import HpdlError


class HpoError(HpdlError):
    """Root of hpdl.hpo errors."""


class HpoConfigError(HpoError, ValueError):
    """A study file, search space, pool or policy option is invalid; the message names the field."""


class TrialFailedError(HpoError):
    """A trial raised, ran out of memory, or its process died; ``kind`` is 'error', 'oom' or 'died'."""

    def __init__(self, message: str, kind: str = "error"):
        super().__init__(message)
        self.kind = kind


class Preempted(HpoError):
    """Raised inside a trial when the driver asked it to stop and checkpoint (GPU removed or migration)."""
