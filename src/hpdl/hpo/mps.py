"""The private MPS daemon of one study (``mps: start`` in the study file): :class:`hpdl.runtime.mps.MpsDaemon`
raising hpo's own errors. Why MPS pays for packed trials, and how the daemon is kept private and reaped, is
said in :mod:`hpdl.runtime.mps`."""

from __future__ import annotations

from hpdl.hpo.errors import HpoConfigError, HpoError
from hpdl.runtime import mps as _mps
from hpdl.runtime.mps import CONTROL, PID_FILE, daemon_pid

__all__ = ["CONTROL", "PID_FILE", "MpsDaemon", "daemon_pid"]


class MpsDaemon(_mps.MpsDaemon):
    """:class:`hpdl.runtime.mps.MpsDaemon` for a study: raises HpoConfigError when the control program is not
    on ``PATH`` and HpoError when the daemon does not start or another driver's daemon serves the folder."""

    error = HpoError
    config_error = HpoConfigError
    hint = "use mps: false to run without MPS"
