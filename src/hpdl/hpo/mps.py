"""A private NVIDIA MPS control daemon for one study (``mps: start`` in the study file).

Without MPS, processes on one GPU time-slice: a kernel of one process never runs beside a kernel of
another, so co-located launch-bound trials (a small CNN whose kernels fill a few SMs for microseconds) share
the GPU's time, not its SMs. Under MPS (docs.nvidia.com/deploy/mps) the clients' kernels run concurrently,
which is what packing lightweight trials needs to pay off past a summed busy fraction of one.

The daemon here uses its own pipe and log folders (under the study's run folder), so only this study's
worker processes (which get ``CUDA_MPS_PIPE_DIRECTORY`` pointing there) become its clients; other
processes on the GPU are not affected (the GPU's compute mode stays ``Default``; nothing on the card is
changed). It is stopped (``quit``) when the study ends, also after an error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from hpdl.hpo.errors import HpoConfigError, HpoError

CONTROL = "nvidia-cuda-mps-control"


class MpsDaemon:
    """Start/stop an MPS control daemon with private pipe and log folders.

    Args:
        root: folder for ``pipe/`` and ``log/`` (created). Unix socket paths are limited to about 100
            bytes, so a long ``root`` is replaced by a short folder under the system temp dir named by its hash.
        timeout_s: how long ``start``/``stop`` wait for the control pipe to appear/disappear.
    Raises (``start``):
        HpoConfigError: ``nvidia-cuda-mps-control`` is not on ``PATH``.
        HpoError: the daemon did not start (its log folder is named in the message).
    """

    def __init__(self, root: str | os.PathLike, timeout_s: float = 10.0):
        root = Path(root).resolve()
        if len(str(root)) > 60:  # the pipe folder holds unix sockets; keep their paths short (and stable)
            import hashlib
            import tempfile
            root = Path(tempfile.gettempdir()) / f"hpdl-mps-{hashlib.sha1(str(root).encode()).hexdigest()[:12]}"
        self.pipe_dir, self.log_dir = root / "pipe", root / "log"
        self.timeout_s = timeout_s
        self.started = False

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs in its environment (before it creates a CUDA context)."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def _run(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
        exe = shutil.which(CONTROL)
        if exe is None:
            raise HpoConfigError(f"mps: start needs {CONTROL} on PATH (part of the NVIDIA driver); "
                                 "use mps: false to run without MPS")
        return subprocess.run([exe, *args], input=stdin, env={**os.environ, **self.env}, capture_output=True,
                              text=True, timeout=self.timeout_s)

    def start(self) -> "MpsDaemon":
        """Start the daemon and wait until its control pipe exists; idempotent."""
        if self.started:
            return self
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if (self.pipe_dir / "control").exists():  # left by an earlier run of this study: quit it, start afresh
            self.started = True
            self.stop()
            for f in self.pipe_dir.iterdir():
                f.unlink(missing_ok=True)
        res = self._run(["-d"])
        deadline = time.monotonic() + self.timeout_s
        while not (self.pipe_dir / "control").exists():
            if time.monotonic() > deadline:
                raise HpoError(f"{CONTROL} -d did not create {self.pipe_dir / 'control'} within "
                               f"{self.timeout_s:.0f} s (exit code {res.returncode}: {res.stderr.strip()[:200]}); "
                               f"see {self.log_dir}")
            time.sleep(0.05)
        self.started = True
        return self

    def stop(self) -> None:
        """Ask the daemon to quit (it stops its server once the clients are gone) and wait until it exited:
        its pid file names a dead process, or its control pipe is gone; never raises."""
        if not self.started:
            return
        self.started = False
        pid = self._pid()
        try:
            self._run([], stdin="quit\n")
        except (OSError, subprocess.SubprocessError, HpoError):
            return
        deadline = time.monotonic() + self.timeout_s
        while (self.pipe_dir / "control").exists() and time.monotonic() < deadline:
            if pid is not None and not _alive(pid):
                break
            time.sleep(0.05)
        if pid is not None and not _alive(pid):  # the daemon may leave its pipe behind
            (self.pipe_dir / "control").unlink(missing_ok=True)

    def _pid(self) -> int | None:
        """The control daemon's pid from the pid file it writes in its pipe folder, if any."""
        for f in self.pipe_dir.glob("*.pid"):
            try:
                return int(f.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
        return None

    def __enter__(self) -> "MpsDaemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
