"""hpdl's one shared-memory module (hpdl.comm.transport.shm): the segment primitive, and the owner-lock crash
safety that hpdl.comm's NodeSharedBuffer and hpdl.offload's buffers share. Processes are killed with SIGKILL (no
atexit, no finalizers) and their segments must go at the next sweep, and only then."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from hpdl.comm.transport import shm

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def _start(code):
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)


def _wait_for(pred, what, limit=60.0):
    """Wait for an event (a file appearing), with a limit far above a loaded machine's start-up time."""
    deadline = time.monotonic() + limit
    while not pred():
        assert time.monotonic() < deadline, f"{what} did not happen within {limit:.0f}s"
        time.sleep(0.05)


def _kill(p):
    p.kill()  # SIGKILL
    p.wait()


def test_create_attach_unlink_round_trip(tmp_path):
    seg = shm.create("test", 24, directory=str(tmp_path))
    name = os.path.basename(seg.path)
    token = shm.owner_token(str(tmp_path))
    assert name.startswith(f"hpdl-test-{token}-") and os.path.exists(tmp_path / f"hpdl-owner-{token}")
    seg.tensor(torch.int64)[:] = torch.tensor([1, 2, 3])
    peer = shm.attach(seg.path)
    assert peer.nbytes == 24 and peer.array("<i8").tolist() == [1, 2, 3]  # the same pages
    peer.array("<i8")[1] = 7
    assert seg.tensor(torch.int64).tolist() == [1, 7, 3]
    with pytest.raises(ValueError, match="expected at least 4096"):
        shm.attach(seg.path, 4096)
    assert shm.unlink(seg.path) and not os.path.exists(seg.path)
    assert peer.tensor(torch.int64).tolist() == [1, 7, 3]  # a mapping outlives the name
    assert not shm.unlink(seg.path)
    with pytest.raises(FileNotFoundError):
        shm.attach(seg.path)
    other = tmp_path / "hpdl-test-someone-else"
    other.write_bytes(b"x")
    assert not shm.unlink(str(other)) and other.exists()  # only the creator removes a name
    with pytest.raises(ValueError, match=r"nbytes must be an int >= 0 \(bytes\), got -1"):
        shm.create("test", -1, directory=str(tmp_path))
    with pytest.raises(shm.NoSpaceError, match=f"cannot allocate {1 << 50} bytes of shared memory in {tmp_path}"):
        shm.create("test", 1 << 50, directory=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([f"hpdl-owner-{token}", other.name])  # the failed one is gone


def test_node_buffer_segment_of_a_sigkilled_creator_is_swept(tmp_path):
    """Local rank 0 of two creates the control segment and waits in the barrier for a rank that never comes;
    killed there, inside the window where the name exists, it leaves the segment, which a sweep removes once
    (and only once) the creator is dead."""
    code = ("import sys\n"
            "from hpdl.comm.transport import shm\n"
            f"d = {str(tmp_path)!r}\n"
            "shm.NodeSharedBuffer('feedbeef', 0, 0, [0, 1], shm.owner_token(d), 4, timeout=120.0, directory=d)\n")
    p = _start(code)
    try:
        _wait_for(lambda: any(n.endswith("-feedbeef-n0-c") for n in os.listdir(tmp_path)),
                  "the creator's control segment")
        assert shm.sweep(str(tmp_path)) == []  # its creator lives: kept
    finally:
        _kill(p)
    left = sorted(os.listdir(tmp_path))
    assert len(left) == 2 and left[0].startswith("hpdl-comm-") and left[1].startswith("hpdl-owner-"), left
    assert sorted(os.path.basename(r) for r in shm.sweep(str(tmp_path))) == left
    assert os.listdir(tmp_path) == []


def test_the_sweep_is_not_fooled_by_a_live_pid(tmp_path):
    """An owner whose lock is free is gone even when its pid names a live process (a recycled pid, or a pid
    of another pid namespace): here the pid of this very process."""
    token = f"{os.getpid()}x0badf00d"
    (tmp_path / f"hpdl-owner-{token}").write_bytes(b"")  # nobody holds its lock
    (tmp_path / f"hpdl-comm-{token}-0a0b0c0d-n0-c").write_bytes(b"\0" * 64)
    (tmp_path / f"hpdl-offload-buf-{token}-3").write_bytes(b"\0" * 64)
    (tmp_path / "hpdl-comm-4242x12345678-0a0b0c0d-n0-c").write_bytes(b"")  # no owner file: not ours to judge
    assert len(shm.sweep(str(tmp_path))) == 3
    assert os.listdir(tmp_path) == ["hpdl-comm-4242x12345678-0a0b0c0d-n0-c"]


def test_a_creator_killed_while_its_forked_child_lives_is_swept(tmp_path):
    """A forked child drops its inherited copy of the owner lock, so the parent's death frees it."""
    code = ("import os, time\n"
            "from hpdl.comm.transport import shm\n"
            f"seg = shm.create('test', 64, directory={str(tmp_path)!r})\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    time.sleep(120)\n"
            "    os._exit(0)\n"
            "print(pid, seg.path, flush=True)\n"
            "time.sleep(120)\n")
    p = _start(code)
    child = None
    try:
        child, path = p.stdout.readline().split()
        child = int(child)
    finally:
        _kill(p)
    try:
        assert os.path.exists(path)
        assert path in shm.sweep(str(tmp_path)) and os.listdir(tmp_path) == []
    finally:
        if child:
            os.kill(child, signal.SIGKILL)


def test_a_normal_exit_leaves_nothing(tmp_path):
    code = ("from hpdl.comm.transport import shm\n"
            f"segs = [shm.create('test', 64, directory={str(tmp_path)!r}) for _ in range(2)]\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV, timeout=120)
    assert os.listdir(tmp_path) == []


def test_names_are_checked_and_empty_segments_map(tmp_path):
    with pytest.raises(ValueError, match=r"kind='a/b': expected letters, digits and dashes"):
        shm.create("a/b", 8, directory=str(tmp_path))
    with pytest.raises(ValueError, match=r"tail='x_y': expected letters, digits and dashes"):
        shm.create("test", 8, tail="x_y", directory=str(tmp_path))
    seg = shm.create("test", 0, directory=str(tmp_path))
    assert seg.tensor().numel() == 0 and seg.array().size == 0 and os.path.getsize(seg.path) == 1
    seg.unlink()


def test_sizes_must_be_ints_and_a_missing_directory_is_named(tmp_path):
    # a float was truncated (3.7 -> 3 bytes), a string a raw TypeError, a negative attach size a Segment of -5 bytes
    for bad, exc in (("5", TypeError), (3.7, TypeError), (True, TypeError), (-2, ValueError)):
        with pytest.raises(exc, match=f"nbytes must be an int >= 0 \\(bytes\\), got {bad!r}"):
            shm.create("test", bad, directory=str(tmp_path))
    seg = shm.create("test", 8, directory=str(tmp_path))
    for bad, exc in ((-5, ValueError), (2.0, TypeError)):
        with pytest.raises(exc, match=f"nbytes must be an int >= 0 \\(bytes\\), got {bad!r}"):
            shm.attach(seg.path, bad)
    assert shm.attach(seg.path, np.int64(4)).nbytes == 4   # numpy ints are ints
    seg.unlink()
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=f"shared-memory directory {missing} does not exist"):
        shm.create("test", 8, directory=str(missing))
    assert not missing.exists()
