"""A private NVIDIA MPS control daemon: for one hpo study (``mps: start`` in the study file), or for ranks
that share a GPU (``hpdl.runtime.spawn(..., ranks_per_gpu=N, mps=True)``).

Without MPS, processes on one GPU time-slice: a kernel of one process never runs beside a kernel of
another, so co-located launch-bound trials (a small CNN whose kernels fill a few SMs for microseconds) share
the GPU's time, not its SMs. Under MPS (docs.nvidia.com/deploy/mps) the clients' kernels run concurrently,
which is what packing lightweight trials needs to pay off past a summed busy fraction of one.

The daemon here uses its own pipe and log folders (under the study's run folder, or a temporary folder), so
only the processes started for it (which get ``CUDA_MPS_PIPE_DIRECTORY`` pointing there) become its clients; other
processes on the GPU are not affected (the GPU's compute mode stays ``Default``; nothing on the card is
changed). It is stopped (``quit``) when the study or job ends, also after an error; a small reaper process quits
it if its owner itself is killed (SIGTERM, SIGKILL), so a dead owner leaves no daemon behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from hpdl.runtime.errors import HpdlError
from hpdl.runtime.procs import pid_alive

CONTROL = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the daemon into its pipe folder


class MpsError(HpdlError):
    """The MPS daemon did not start or another live daemon serves its folder."""


class MpsConfigError(MpsError, ValueError):
    """MPS was asked for where it cannot run (``nvidia-cuda-mps-control`` is not on ``PATH``)."""

# Runs beside the driver: once the driver is gone (its parent pid changed), quit the daemon, then kill it.
_REAPER = r"""
import os, shutil, signal, subprocess, sys, time
ppid, pid, exe, temp_root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # the driver stops the daemon itself
while os.getppid() == ppid:
    time.sleep(0.5)
try:
    subprocess.run([exe], input="quit\n", text=True, timeout=10, capture_output=True)
except Exception:
    pass
for _ in range(40):
    try:
        os.kill(pid, 0)
    except OSError:
        break
    time.sleep(0.1)
else:
    try:
        if b"mps" in open(f"/proc/{pid}/cmdline", "rb").read():
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
if temp_root:
    shutil.rmtree(temp_root, ignore_errors=True)
"""


class MpsDaemon:
    """Start/stop an MPS control daemon with private pipe and log folders.

    Args:
        root: folder for ``pipe/`` and ``log/`` (created). Unix socket paths are limited to about 100
            bytes, so for a long ``root`` the pipe folder is a short one under the system temp dir named by
            its hash (removed again by ``stop``); the log folder stays under ``root``.
        timeout_s: how long ``start``/``stop`` wait for the daemon to come up / go away.
    Raises (``start``):
        MpsConfigError (``config_error``): ``nvidia-cuda-mps-control`` is not on ``PATH``.
        MpsError (``error``): the daemon did not start (its log folder is named in the message; a
            half-started daemon is stopped first), or a live daemon already serves this folder.

    A subsystem sets ``error``, ``config_error`` and ``hint`` (the way out it offers) in a subclass so that
    the errors are its own (``hpdl.hpo.mps``).
    """

    error: type[Exception] = MpsError
    config_error: type[Exception] = MpsConfigError
    hint = "run without MPS (mps=False)"

    def __init__(self, root: str | os.PathLike, timeout_s: float = 10.0):
        root = Path(root).resolve()
        self._temp_root = None
        self.pipe_dir, self.log_dir = root / "pipe", root / "log"
        if len(str(root)) > 60:  # the pipe folder holds unix sockets; keep their paths short (and stable)
            self._temp_root = Path(tempfile.gettempdir()) / f"hpdl-mps-{hashlib.sha1(str(root).encode()).hexdigest()[:12]}"
            self.pipe_dir = self._temp_root / "pipe"
        self.timeout_s = timeout_s
        self.started = False
        self._reaper: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs in its environment (before it creates a CUDA context)."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    @classmethod
    def _exe(cls) -> str:
        exe = shutil.which(CONTROL)
        if exe is None:
            raise cls.config_error(f"MPS needs {CONTROL} on PATH (part of the NVIDIA driver); "
                                         f"{cls.hint}")
        return exe

    def _run(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self._exe(), *args], input=stdin, env={**os.environ, **self.env},
                              capture_output=True, text=True, timeout=self.timeout_s)

    def start(self) -> "MpsDaemon":
        """Start the daemon, wait until it answers (control pipe and pid file), start its reaper; idempotent."""
        if self.started:
            return self
        exe = self._exe()
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        left = daemon_pid(self.pipe_dir)
        if left is not None:
            raise self.error(f"an MPS daemon (pid {left}) already serves {self.pipe_dir}: is another owner "
                             "(driver of this study, job) running? Stop it first")
        for f in self.pipe_dir.iterdir():  # a daemon killed earlier leaves its pipe and pid file
            with contextlib.suppress(OSError):
                f.unlink()
        self.started = True  # from here on, stop() cleans up whatever did start
        try:
            res = self._run(["-d"])
            deadline = time.monotonic() + self.timeout_s
            while (pid := daemon_pid(self.pipe_dir)) is None:
                if time.monotonic() > deadline:
                    raise self.error(f"{CONTROL} -d did not come up in {self.pipe_dir} within {self.timeout_s:.0f} s "
                                   f"(exit code {res.returncode}: {res.stderr.strip()[:200]}); see {self.log_dir}")
                time.sleep(0.05)
        except BaseException as exc:   # also Ctrl-C while waiting: "-d" may have started the daemon already
            self.stop()
            if isinstance(exc, (MpsError, self.error)) or not isinstance(exc, (OSError, subprocess.SubprocessError)):
                raise
            raise self.error(f"{CONTROL} -d failed: {exc}") from exc
        self._reaper = subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid()), str(pid), exe,
                                         str(self._temp_root or "")],
                                        env={**os.environ, **self.env}, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)  # outlives a kill of the driver's group
        return self

    def stop(self) -> None:
        """Quit the daemon (it stops its server once the clients are gone) and wait until it exited; kill it
        if it does not; remove a temp folder made for a long ``root``. Warns instead of raising."""
        if not self.started:
            return
        self.started = False
        if self._reaper is not None:
            with contextlib.suppress(OSError):
                self._reaper.send_signal(signal.SIGTERM)
                self._reaper.wait(5)
            self._reaper = None
        pid = daemon_pid(self.pipe_dir)
        try:
            self._run([], stdin="quit\n")
        except (OSError, subprocess.SubprocessError, MpsError, self.error, self.config_error) as exc:
            warnings.warn(f"MPS daemon in {self.pipe_dir}: quit failed ({exc}); killing it", stacklevel=2)
        deadline = time.monotonic() + self.timeout_s
        while pid is not None and pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid is not None and pid_alive(pid):
            warnings.warn(f"MPS daemon pid {pid} did not quit within {self.timeout_s:.0f} s; killing it", stacklevel=2)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for name in ("control", PID_FILE):  # the daemon may leave them behind
            with contextlib.suppress(OSError):
                (self.pipe_dir / name).unlink()
        if self._temp_root is not None:
            shutil.rmtree(self._temp_root, ignore_errors=True)

    def __enter__(self) -> "MpsDaemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def daemon_pid(pipe_dir: str | os.PathLike) -> int | None:
    """Pid of a live MPS control daemon serving ``pipe_dir`` (its control pipe exists and the pid in its pid
    file is a running process), else None: a pipe left by a killed daemon does not count."""
    pipe_dir = Path(pipe_dir)
    if not (pipe_dir / "control").exists():
        return None
    try:
        pid = int((pipe_dir / PID_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if pid > 0 and pid_alive(pid) else None

