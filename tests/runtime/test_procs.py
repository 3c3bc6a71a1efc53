"""hpdl.runtime.procs.pid_alive: running, exited-and-reaped, zombie, and invalid pids."""

import os
import subprocess
import sys

import pytest

from hpdl.runtime.procs import pid_alive


def test_running_reaped_and_zombie_processes():
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert pid_alive(child.pid)
        child.kill()
        import time
        deadline = time.monotonic() + 10
        while pid_alive(child.pid):  # killed but not reaped yet: a zombie, which is not alive
            assert time.monotonic() < deadline, "a killed child still counts as alive"
            time.sleep(0.02)
    finally:
        child.kill()
        child.wait(10)
    assert not pid_alive(child.pid)  # reaped


@pytest.mark.parametrize("pid", [0, -1])
def test_process_group_ids_are_refused(pid):
    with pytest.raises(ValueError, match="pid"):
        pid_alive(pid)


def test_hpo_heartbeat_pid_field_of_any_json_value():
    """A study's heartbeat from this host counts only while its pid runs; a missing, zero, negative or
    non-numeric pid field (a hand-edited or foreign store) counts as not running instead of raising."""
    import socket
    import time

    from hpdl.hpo.lock import live_drivers

    me, now = socket.gethostname(), time.time()
    beats = {f"hpdl_driver@{me}": {"beat_at": now, "pid": os.getpid()}}
    assert [d["pid"] for d in live_drivers(beats, now)] == [os.getpid()]
    for pid in (None, 0, -5, "x", [1]):
        assert live_drivers({f"hpdl_driver@{me}": {"beat_at": now, "pid": pid}}, now) == []
