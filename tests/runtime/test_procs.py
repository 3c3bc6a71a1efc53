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
