"""Errors of hpdl.moe; each message names the offending argument (or rank) and the expected value."""

from hpdl.runtime.errors import HpdlError


class MoEError(HpdlError, ValueError):
    """Bad argument to an hpdl.moe function: a trace, placement, world size or expert count that does not fit."""


class PlacementError(MoEError):
    """A placement file or array is inconsistent (not balanced, wrong world size, wrong model)."""
