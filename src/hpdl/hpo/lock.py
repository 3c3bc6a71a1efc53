"""One live driver per study: an advisory file lock in the run folder plus a heartbeat in the study store.

- **File lock** (``fcntl.flock`` on ``<run_dir>/locks/<study>-<hash>.lock``, and for a SQLite store on the
  same name in the database's folder, held for the driver's life): a second driver of the same study and run folder on this host (or on a shared file system) is
  refused with the holder's host, pid and start time, which the holder writes into the file. The kernel
  drops the lock when the holder dies (``kill -9`` included), so a ``resume`` after a crash never waits.
- **Heartbeat** (study user attribute ``hpdl_driver@<host>`` = ``{pid, run_dir, started_at, beat_at}``,
  written every :data:`HEARTBEAT_S` seconds): a driver on the same host that uses another run folder with the
  same store is refused too while the recorded pid is alive and its beat is younger than :data:`STALE_S`.
  Drivers on other hosts may share a study on purpose (many nodes on PostgreSQL; each recovers only its
  own host's trials), so their heartbeats are reported, not refused; ``hpdl hpo status`` uses them to tell
  a trial of a dead driver from a running one.

Optuna's own heartbeat (``RDBStorage(heartbeat_interval=...)``) is per trial and is recorded only inside
``Study.optimize``; its ``fail_stale_trials`` fails stale trials and retries them through a callback that
counts attempts, which is the behaviour this package avoids for a driver's death (a driver's death spends
no attempt). The study attribute gives the same evidence (a beat and its age) through the public
``Study.set_user_attr``, one write per study every few seconds instead of one per trial.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import time
from pathlib import Path

from hpdl.hpo.errors import HpoError
from hpdl.runtime.procs import pid_alive

HEARTBEAT_S = 5.0   # a live driver writes its heartbeat this often
STALE_S = 30.0      # a heartbeat older than this is a dead (or hung) driver's


def lock_path(run_dir: str | os.PathLike, study: str, storage: str) -> Path:
    """The lock file of ``study`` in ``storage`` under ``run_dir``. The digest covers the study's full name
    too: studies ``a/b`` and ``a_b`` (one file-name stem) have two locks."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", study)[:80]
    digest = hashlib.sha1(f"{storage}\0{study}".encode()).hexdigest()[:10]
    return Path(run_dir) / "locks" / f"{safe}-{digest}.lock"


def lock_paths(run_dir: str | os.PathLike, study: str, storage: str) -> list[Path]:
    """Every lock file a driver of ``study`` takes: the run folder's, and for a SQLite store one in the
    database's folder too, so that drivers that share one store from two run folders exclude each other
    by the kernel's lock, not only by the heartbeat (two that start within the same few milliseconds both
    passed the heartbeat check: each read the study before the other's first beat)."""
    from hpdl.hpo.spec import sqlite_path

    paths = [lock_path(run_dir, study, storage)]
    if (db := sqlite_path(storage)) is not None:
        # per host: drivers of other hosts may share a store on a shared file system on purpose (many nodes)
        p = lock_path(db.resolve().parent, f"{study}@{socket.gethostname()}", storage)
        paths.append(p)
    return paths


# store locks this process holds, with how many of its drivers hold each: several drivers in one process
# (tests that stand in for nodes) share one, as the heartbeat check lets a driver's own pid through
_HELD: dict[str, list[int]] = {}


def heartbeat_key(host: str) -> str:
    return f"hpdl_driver@{host}"


def _pid_alive(pid) -> bool:
    """A heartbeat's ``pid`` field (any JSON value) names a live process of this host."""
    try:
        return int(pid) > 0 and pid_alive(int(pid))
    except (TypeError, ValueError):
        return False


def live_drivers(user_attrs: dict, now: float | None = None) -> list[dict]:
    """The drivers whose heartbeat in a study's ``user_attrs`` is younger than :data:`STALE_S` (and, on this
    host, whose pid is alive), each ``{host, pid, run_dir, started_at, beat_at, age_s}``."""
    now = time.time() if now is None else now
    me = socket.gethostname()
    out = []
    for key, v in user_attrs.items():
        if not key.startswith("hpdl_driver@") or not isinstance(v, dict) or "beat_at" not in v:
            continue
        host = key.partition("@")[2]
        age = now - float(v["beat_at"])
        if age > STALE_S or (host == me and not _pid_alive(v.get("pid"))):
            continue
        out.append({**v, "host": host, "age_s": age})
    return out


class StudyLock:
    """The lock of one study for one driver (see module docstring). ``acquire`` before touching the study's
    trials, ``check_heartbeat`` once the study is open, ``beat`` from the driver loop, ``release`` at the end.

    Args:
        run_dir: the study's run folder (created by the caller).
        study: study name. storage: the store's URL (part of the lock's name).
    """

    def __init__(self, run_dir: str | os.PathLike, study: str, storage: str):
        self.paths = lock_paths(run_dir, study, storage)
        self.path = self.paths[0]
        self.run_dir, self.study_name, self.storage = str(Path(run_dir).resolve()), study, storage
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._fds: list[int] = []
        self._shared: list[str] = []  # keys of _HELD this lock counts in
        self._study = None
        self._last_beat = 0.0
        self.started_at = time.time()

    def acquire(self) -> None:
        """Take the file lock without waiting.

        Raises:
            HpoError: another process holds it; the message names that driver (host, pid, start time).
        """
        import fcntl

        for i, path in enumerate(self.paths):
            key = str(path.resolve()) if i else ""
            if key in _HELD:  # this process already holds the store's lock
                _HELD[key][1] += 1
                self._shared.append(key)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                self.release()  # the locks taken so far
                raise HpoError(f"study {self.study_name!r} is being run by a live driver: {_describe(holder)} "
                               f"(lock {path}); stop it (Ctrl-C or SIGTERM) before `hpdl hpo resume`, or "
                               "wait for it to finish") from None
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"host": self.host, "pid": self.pid, "started_at": self.started_at,
                                     "run_dir": self.run_dir}).encode())
            os.fsync(fd)
            if key:
                _HELD[key] = [fd, 1]
                self._shared.append(key)
            else:
                self._fds.append(fd)

    def check_heartbeat(self, study) -> None:
        """Refuse when another live driver of this host beats in ``study`` (an ``optuna.Study``), whatever its
        run folder.

        Raises:
            HpoError: naming that driver's pid, run folder and heartbeat age.
        """
        for d in live_drivers(study.user_attrs):
            if d["host"] == self.host and int(d.get("pid", 0)) != self.pid:
                raise HpoError(f"study {self.study_name!r} is being run by a live driver: {_describe(d)}, "
                               f"heartbeat {d['age_s']:.0f} s ago; stop it before `hpdl hpo resume`")
        self._study = study

    def beat(self, force: bool = False) -> None:
        """Write this driver's heartbeat into the study, at most every :data:`HEARTBEAT_S` seconds."""
        now = time.time()
        if self._study is None or (not force and now - self._last_beat < HEARTBEAT_S):
            return
        self._last_beat = now
        self._study.set_user_attr(heartbeat_key(self.host), {"pid": self.pid, "run_dir": self.run_dir,
                                                             "started_at": self.started_at, "beat_at": now})

    def release(self) -> None:
        """Mark the heartbeat stopped and drop the file lock; idempotent, never raises."""
        if self._study is not None:
            with contextlib.suppress(Exception):  # a store that went away must not hide the study's outcome
                self._study.set_user_attr(heartbeat_key(self.host), {"pid": self.pid, "run_dir": self.run_dir,
                                                                     "stopped_at": time.time()})
            self._study = None
        for key in self._shared:
            held = _HELD.get(key)
            if held is not None:
                held[1] -= 1
                if held[1] <= 0:
                    del _HELD[key]
                    self._fds.append(held[0])
        self._shared = []
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the descriptor releases the flock
        self._fds = []


def _read_holder(fd: int) -> dict:
    with contextlib.suppress(OSError, ValueError):
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 4096).decode() or "{}")
    return {}


def _describe(d: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(d["started_at"]))) if d.get("started_at") else "?"
    return f"pid {d.get('pid', '?')} on host {d.get('host', '?')} (run_dir {d.get('run_dir', '?')}, started {when})"
