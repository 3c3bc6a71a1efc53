"""Process helpers shared by the subsystems (no torch import)."""

from __future__ import annotations

import psutil


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs on this host: it exists and is not a zombie (exited, not yet reaped). A
    process of another user counts as alive.

    Raises:
        ValueError: ``pid <= 0`` (0 and negative values address process groups, not one process).
    """
    if pid <= 0:
        raise ValueError(f"pid={pid}, expected a process id > 0")
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # it exists, owned by someone else
        return True
