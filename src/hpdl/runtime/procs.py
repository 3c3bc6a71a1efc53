"""Process helpers shared by the subsystems (no torch import)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs on this host: it exists and is not a zombie (exited, not yet reaped,
    which still answers ``kill(pid, 0)``). A process of another user counts as alive.

    Raises:
        ValueError: ``pid <= 0`` (0 and negative values address process groups, not one process).
    """
    if pid <= 0:
        raise ValueError(f"pid={pid}, expected a process id > 0")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS) or an unreadable entry: kill(pid, 0) said it exists
        return True
