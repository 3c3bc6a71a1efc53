"""Trial checkpoints: one file per configuration (lineage), in a folder that belongs to one study in one store.

Layout: ``<run_dir>/checkpoints/<study>-<uid12>/lineage-<N>.pt``, where ``uid`` is a random id the driver
stores in the study (user attribute ``hpdl_uid``) when it first opens it. Two studies in one run folder, a
study of the same name in another store, or a study deleted and created again have different ids, so one
never reads another's checkpoints. Each file also records whose it is (``hpdl_meta``: study id, lineage and
the trial's resolved parameters); a file whose record differs from the trial that loads it (copied, or
written by an older layout) is refused with :class:`CheckpointMismatch`, which fails the trial for good
instead of continuing someone else's training.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from pathlib import Path
from typing import Any

from hpdl.hpo.errors import HpoError
from hpdl.runtime.procs import pid_alive

META_KEY = "hpdl_meta"


class CheckpointMismatch(HpoError):
    """A checkpoint on a trial's path was written for another study, configuration or parameters."""


class CheckpointWriteError(HpoError):
    """A checkpoint could not be written (folder removed or made read-only, disk full): the run folder's
    fault, not the trial's, so it spends no attempt; the driver stops the study (see :func:`save`)."""


def checkpoint_dir(run_dir: str | os.PathLike, study: str, uid: str) -> Path:
    """The checkpoint folder of study ``study`` whose stored id is ``uid``."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", study)[:80]
    return Path(run_dir) / "checkpoints" / f"{safe}-{uid[:12]}"


def check_writable(path: str | os.PathLike, what: str) -> None:
    """Create ``path`` (a folder) if needed and write and remove a probe file in it.

    Raises:
        HpoError: naming ``what`` and ``path`` and the operating system's reason.
    """
    p = Path(path)
    probe = p / f".hpdl-write-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise HpoError(f"{what} {str(p)!r} is not writable: {exc.strerror or exc} "
                       "(choose another run_dir, e.g. --run-dir)") from None


def save(path: Path, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write ``state`` with its owner record ``meta`` atomically (temporary file, then rename).

    Raises:
        CheckpointWriteError: the folder or file cannot be written; names the path and the system's reason
            (every trial of the study would fail the same way: retrying would spend every configuration's
            attempts on the run folder's fault).
    """
    import torch

    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save({**state, META_KEY: meta}, f)
            f.flush()
            os.fsync(f.fileno())   # the data is on disk before the rename makes it the checkpoint
        os.replace(tmp, path)
        _fsync_dir(path.parent)    # and the rename itself survives a power loss
        _remove_stale_tmp(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise CheckpointWriteError(f"cannot write checkpoint {str(path)!r}: "
                                   f"{exc.strerror or exc} ({type(exc).__name__})") from None
    except RuntimeError as exc:  # torch.save reports a failed write of its zip archive as a RuntimeError
        if "write" not in str(exc) and "file" not in str(exc):
            raise
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise CheckpointWriteError(f"cannot write checkpoint {str(path)!r}: {exc}") from None


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):   # not every file system lets a folder be opened or synced
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_stale_tmp(path: Path) -> None:
    """Delete ``<lineage>.tmp<pid>`` files left by writers that died mid-write (kill -9)."""
    for tmp in path.parent.glob(f"{path.stem}.tmp*"):
        pid = tmp.suffix[len(".tmp"):]
        if pid.isdigit() and int(pid) not in (0, os.getpid()) and not pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()


def load(path: Path, meta: dict[str, Any], map_location=None) -> dict[str, Any] | None:
    """The state at ``path`` (None if there is none), checked against the loading trial's ``meta``.

    Raises:
        CheckpointMismatch: the file's owner record is missing or differs (study id, lineage or parameters);
            the message names the file and the differing fields.
    """
    import torch

    if not path.exists():
        return None
    state = torch.load(path, map_location=map_location, weights_only=False)
    got = state.pop(META_KEY, None) if isinstance(state, dict) else None
    if got is None:
        raise CheckpointMismatch(f"checkpoint {str(path)!r} has no owner record (written by another tool or an "
                                 "older hpdl): refusing to continue a trial from it; delete it to start afresh")
    diff = [k for k in ("study_uid", "lineage") if got.get(k) != meta.get(k)]
    mine, theirs = meta.get("params", {}), got.get("params", {})
    diff += [f"params.{k} ({theirs.get(k)!r} in the file, {mine.get(k)!r} in the trial)"
             for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    if diff:
        more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
        raise CheckpointMismatch(f"checkpoint {str(path)!r} belongs to another trial: differs in "
                                 f"{', '.join(diff[:4])}{more}; refusing to continue from it")
    return state
