"""hpdl.hpo.mps: the private MPS daemon's wiring, against a stand-in ``nvidia-cuda-mps-control`` script
(CI has no GPU driver): start waits for the control pipe, stop sends ``quit``, errors name the cause."""

import os
import stat

import pytest

from hpdl.hpo.errors import HpoConfigError, HpoError
from hpdl.hpo.mps import MpsDaemon

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


def test_leftover_daemon_of_an_earlier_run_is_quit_first(tmp_path, fake_control):
    first = MpsDaemon(tmp_path / "mps").start()
    first.started = False  # as if the earlier driver had been killed
    MpsDaemon(tmp_path / "mps").start().stop()
    assert (first.log_dir / "control.log").read_text().split() == ["start", "quit", "start", "quit"]


def test_long_root_gets_a_short_pipe_folder(tmp_path, fake_control):
    d = MpsDaemon(tmp_path / ("x" * 80))
    assert len(str(d.pipe_dir)) < 100


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
