"""Exceptions of hpdl.hpo; all derive from :class:`hpdl.runtime.errors.HpdlError`."""

from __future__ import annotations

from hpdl.runtime.errors import HpdlError


class HpoError(HpdlError):
    """Root of hpdl.hpo errors."""


class HpoConfigError(HpoError, ValueError):
    """A study file, search space, pool or policy option is invalid; the message names the field."""


class Preempted(HpoError):
    """Raised inside a trial when the driver asked it to stop and checkpoint (GPU removed or migration)."""
