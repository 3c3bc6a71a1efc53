"""hpdl.hpo.mps: the private MPS daemon's wiring, against a stand-in ``nvidia-cuda-mps-control`` script
(CI has no GPU driver): start waits for the control pipe, stop sends ``quit``, errors name the cause."""

import os
import stat

import pytest

from hpdl.hpo.errors import HpoConfigError, HpoError
from hpdl.hpo.mps import MpsDaemon, daemon_pid

FAKE = """#!/bin/sh
# stand-in for nvidia-cuda-mps-control: -d creates the control pipe and a pid file of a background process
# (the "daemon"); "quit" on stdin ends that process and, unless KEEP_PIPE is set, removes the pipe
if [ "$1" = "-d" ]; then
  [ -n "$FAIL_START" ] && { echo "cannot start" >&2; exit 1; }
  mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"; echo start >> "$CUDA_MPS_LOG_DIRECTORY/control.log"
  sleep 600 >/dev/null 2>&1 &
  echo $! > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
  exit 0
fi
read cmd
echo "$cmd" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"
if [ "$cmd" = quit ]; then
  kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")"
  [ -z "$KEEP_PIPE" ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
fi
exit 0
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text(FAKE)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return exe


def test_start_waits_for_the_pipe_and_stop_quits(tmp_path, fake_control):
    d = MpsDaemon(tmp_path / "mps")
    with d:
        assert (d.pipe_dir / "control").exists()
        assert d.env == {"CUDA_MPS_PIPE_DIRECTORY": str(d.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(d.log_dir)}
        d.start()  # idempotent
    assert not (d.pipe_dir / "control").exists()
    assert (d.log_dir / "control.log").read_text().split() == ["start", "quit"]
    d.stop()  # idempotent


def test_a_live_daemon_on_the_folder_is_refused_a_dead_one_cleaned_up(tmp_path, fake_control):
    import signal

    first = MpsDaemon(tmp_path / "mps").start()
    with pytest.raises(HpoError, match="already serves"):   # another driver of the same study
        MpsDaemon(tmp_path / "mps").start()
    pid = daemon_pid(first.pipe_dir)
    os.kill(pid, signal.SIGKILL)                             # killed: its pipe and pid file stay behind
    first._reaper.kill()
    wait_dead(pid)
    assert daemon_pid(first.pipe_dir) is None and (first.pipe_dir / "control").exists()
    second = MpsDaemon(tmp_path / "mps").start()
    assert daemon_pid(second.pipe_dir) not in (None, pid)
    second.stop()


def test_a_killed_driver_leaves_no_daemon(tmp_path, fake_control):
    """SIGKILL of the process that started the daemon: its reaper quits the daemon."""
    import signal
    import subprocess
    import sys

    code = ("import sys, time; from hpdl.hpo.mps import MpsDaemon, daemon_pid; "
            "d = MpsDaemon(sys.argv[1]).start(); print(daemon_pid(d.pipe_dir), flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "mps")], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    wait_dead(pid)
    assert "quit" in (tmp_path / "mps" / "log" / "control.log").read_text().split()


def wait_dead(pid: int, timeout_s: float = 10.0) -> None:
    import time

    from hpdl.runtime.procs import pid_alive as _alive

    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive after {timeout_s} s"
        time.sleep(0.05)


def test_long_root_gets_a_short_pipe_folder_removed_at_stop(tmp_path, fake_control):
    d = MpsDaemon(tmp_path / ("x" * 80)).start()
    assert len(str(d.pipe_dir)) < 100 and d.pipe_dir.exists()
    d.stop()
    assert not d.pipe_dir.parent.exists()


def test_errors_name_the_cause(tmp_path, fake_control, monkeypatch):
    monkeypatch.setenv("FAIL_START", "1")
    with pytest.raises(HpoError, match="cannot start"):
        MpsDaemon(tmp_path / "mps", timeout_s=0.3).start()
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(HpoConfigError, match="nvidia-cuda-mps-control on PATH"):
        MpsDaemon(tmp_path / "mps2").start()


def test_stop_does_not_wait_for_a_pipe_the_exited_daemon_left(tmp_path, fake_control, monkeypatch):
    import time

    monkeypatch.setenv("KEEP_PIPE", "1")
    d = MpsDaemon(tmp_path / "mps", timeout_s=5.0).start()
    t = time.monotonic()
    d.stop()
    assert time.monotonic() - t < 2.0 and not (d.pipe_dir / "control").exists()
