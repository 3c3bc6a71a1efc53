"""The launch mode that puts several ranks on one GPU (``ranks_per_gpu`` / ``HPDL_RANKS_PER_GPU``), on CPU:
device mapping, no NCCL group, what hpdl.comm accepts, the private MPS daemon's start/stop, the bench's note
and refusals. The GPU side is tests/comm/test_comm_shared_gpu.py (``pytest -m gpu``)."""

import os
import stat
import subprocess
import sys

import pytest
import torch

from hpdl.runtime import Topology, spawn
from hpdl.runtime.launch import device_for, rank_environment, ranks_per_gpu_of


def test_device_mapping_shares_gpus_and_drops_nccl():
    assert device_for("cuda", 0, 1, device_count=8) == (torch.device("cuda", 0), "nccl")
    assert device_for("cuda", 5, 1, device_count=8) == (torch.device("cuda", 5), "nccl")
    for r in range(8):
        assert device_for("cuda", r, 8, device_count=1) == (torch.device("cuda", 0), "gloo")
        assert device_for("cuda", r, 2, device_count=4) == (torch.device("cuda", r // 2), "gloo")
    assert device_for("cpu", 3, 4) == (torch.device("cpu"), "gloo")


def test_device_mapping_names_the_argument():
    with pytest.raises(RuntimeError, match=r"local rank 2 has no GPU.*ranks_per_gpu=1.*at least 3"):
        device_for("cuda", 2, 1, device_count=1)
    with pytest.raises(ValueError, match="ranks_per_gpu must be an int >= 1, got 0"):
        device_for("cuda", 0, 0, device_count=1)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        device_for("tpu", 0, 1)


def test_ranks_per_gpu_from_argument_or_environment(monkeypatch):
    monkeypatch.delenv("HPDL_RANKS_PER_GPU", raising=False)
    assert ranks_per_gpu_of(None) == 1
    monkeypatch.setenv("HPDL_RANKS_PER_GPU", "4")
    assert ranks_per_gpu_of(None) == 4 and ranks_per_gpu_of(2) == 2
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="ranks_per_gpu must be an int >= 1"):
            ranks_per_gpu_of(bad)
    monkeypatch.setenv("HPDL_RANKS_PER_GPU", "0")
    with pytest.raises(ValueError, match="HPDL_RANKS_PER_GPU must be an int >= 1"):
        ranks_per_gpu_of(None)
    monkeypatch.setenv("HPDL_RANKS_PER_GPU", "two")
    with pytest.raises(ValueError, match="HPDL_RANKS_PER_GPU='two' is invalid"):
        ranks_per_gpu_of(None)


def test_rank_environment():
    assert rank_environment("cuda", 4, 30.0, {"CUDA_MPS_PIPE_DIRECTORY": "/p"}) == {
        "HPDL_TIMEOUT": "30.0", "HPDL_RANKS_PER_GPU": "4", "CUDA_MPS_PIPE_DIRECTORY": "/p"}
    # always pinned, so that a value exported in the parent (another job's) never reaches hpdl.comm in the ranks
    assert rank_environment("cuda", 1, 30.0) == {"HPDL_TIMEOUT": "30.0", "HPDL_RANKS_PER_GPU": "1"}
    assert rank_environment("cpu", 4, 5.0) == {"HPDL_TIMEOUT": "5.0", "HPDL_RANKS_PER_GPU": "1"}


def test_job_ranks_per_gpu_ignores_the_variable_on_cpu_and_refuses_contradictions(monkeypatch):
    from hpdl.runtime.launch import job_ranks_per_gpu

    monkeypatch.setenv("HPDL_RANKS_PER_GPU", "two")   # a GPU-only setting: a CPU job does not read it
    assert job_ranks_per_gpu("cpu", None) == 1 and job_ranks_per_gpu("cpu", 1) == 1
    with pytest.raises(ValueError, match="HPDL_RANKS_PER_GPU='two' is invalid"):
        job_ranks_per_gpu("cuda", None)
    monkeypatch.setenv("HPDL_RANKS_PER_GPU", "4")
    assert job_ranks_per_gpu("cuda", None) == 4 and job_ranks_per_gpu("cuda", 1) == 1
    for bad in (0, -1, True, "2", 2.0):
        with pytest.raises(ValueError, match="ranks_per_gpu must be an int >= 1"):
            job_ranks_per_gpu("cpu", bad)
    with pytest.raises(ValueError, match="ranks_per_gpu=2 needs device='cuda'"):
        job_ranks_per_gpu("cpu", 2)
    with pytest.raises(ValueError, match="ranks_per_gpu=2 needs device='cuda'"):
        spawn(_rank_facts, 2, device="cpu", ranks_per_gpu=2)
    from hpdl.testing.pool import RankPool

    with pytest.raises(ValueError, match="ranks_per_gpu must be an int >= 1, got '2'"):
        RankPool(2, device="cpu", ranks_per_gpu="2")


def test_init_from_env_pins_the_jobs_value(monkeypatch):
    """Under torchrun a CPU job (or ``ranks_per_gpu=1``) with another job's HPDL_RANKS_PER_GPU exported: the
    variable is the job's value afterwards, so hpdl.comm's groups see 1."""
    import torch.distributed as dist

    from hpdl.runtime import init_from_env
    from hpdl.runtime.launch import free_port

    monkeypatch.setenv("HPDL_RANKS_PER_GPU", "two")
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    assert not dist.is_initialized()
    try:
        ctx = init_from_env("cpu", timeout=30)
        assert ctx.ranks_per_gpu == 1 and os.environ["HPDL_RANKS_PER_GPU"] == "1"
        from hpdl.comm.transport.resources import GroupResources

        assert GroupResources(None).ranks_per_gpu == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_topology_reports_shared_gpus():
    t = Topology.emulate(8, None, ranks_per_gpu=8)
    assert t.shares_gpus and t.single_node and t.ranks_per_gpu == 8
    assert not Topology.emulate(8, 4).shares_gpus
    assert Topology.emulate(8, 4, 2) != Topology.emulate(8, 4)
    with pytest.raises(ValueError, match="ranks_per_gpu must be >= 1"):
        Topology(2, (0, 0), ranks_per_gpu=0)


def test_spawn_refuses_bad_requests_before_starting_ranks():
    with pytest.raises(ValueError, match="mps=True needs ranks sharing a GPU"):
        spawn(_rank_facts, 2, device="cpu", mps=True)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        spawn(_rank_facts, 2, device="gpu")
    with pytest.raises(ValueError, match="nprocs must be an int >= 1"):
        spawn(_rank_facts, 0)
    from hpdl.testing.pool import RankPool

    with pytest.raises(ValueError, match="mps=True needs ranks sharing a GPU"):
        RankPool(2, device="cpu", mps=True)


def _rank_facts(ctx):
    """What hpdl.comm makes of a CUDA tensor on this rank's gloo world group: first with the environment the
    launch gave, then with HPDL_RANKS_PER_GPU=2 (what a CUDA launch with shared GPUs sets; no GPU here)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hpdl.comm import api
    from hpdl.comm.transport.resources import GroupResources

    with FakeTensorMode():
        t = torch.empty(4, device="cuda")
    out = {"backend": dist.get_backend(), "cpu_group": ctx.cpu_group is None,
           "env": os.environ.get("HPDL_RANKS_PER_GPU")}
    for case in ("launched", "shared"):
        if case == "shared":
            os.environ["HPDL_RANKS_PER_GPU"] = "2"
        res = GroupResources(None)
        try:
            api._check_tensor("tensor", t, res)   # a CUDA tensor on the gloo group: taken only when GPUs are shared
            accepted = True
        except ValueError as exc:
            accepted = str(exc)
        out[case] = {"cuda_over_gloo": res.cuda_over_gloo, "accepted": accepted}
    return out


def test_gloo_group_takes_cuda_tensors_only_when_gpus_are_shared(monkeypatch):
    """A CPU job started with another job's HPDL_RANKS_PER_GPU (and a malformed HPDL_MPS, GPU sharing only)
    exported in the parent: the ranks see 1 and nothing changes for them; with 2 a gloo group takes CUDA
    tensors."""
    monkeypatch.setenv("HPDL_RANKS_PER_GPU", "2")   # "two" or "0" are pinned the same way (test_rank_environment)
    monkeypatch.setenv("HPDL_MPS", "maybe")
    for r in spawn(_rank_facts, 2, timeout=60):
        assert r["backend"] == "gloo" and r["env"] == "1", r
        assert not r["launched"]["cuda_over_gloo"] and "backend is gloo" in r["launched"]["accepted"], r
        assert r["shared"] == {"cuda_over_gloo": True, "accepted": True}, r


def test_comm_refuses_a_nonpositive_variable(monkeypatch):
    """A process that made its own group (not through hpdl.runtime): HPDL_RANKS_PER_GPU=0 would make ``auto``
    see 0 GPUs and refuse the peer kernels with a message about GPU counts; it is named instead."""
    import torch.distributed as dist

    from hpdl.comm.transport.resources import GroupResources
    from hpdl.runtime.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        for bad in ("0", "-1"):
            monkeypatch.setenv("HPDL_RANKS_PER_GPU", bad)
            with pytest.raises(ValueError, match="HPDL_RANKS_PER_GPU must be an int >= 1"):
                GroupResources(None)
    finally:
        dist.destroy_process_group()


FAKE_MPS = """#!/bin/sh
if [ "$1" = "-d" ]; then
  mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"; echo "-d" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"
  sleep 600 >/dev/null 2>&1 &
  echo $! > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
  exit 0
fi
read cmd
echo "$cmd" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"
[ "$cmd" = quit ] && kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")" && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
"""


def test_private_mps_daemon_started_and_stopped(tmp_path, monkeypatch):
    """The launch mode's MPS daemon (the same class hpo's studies use): started with ``-d`` in private
    folders whose variables the ranks get, quit and gone when the job ends."""
    from hpdl.runtime.launch import _maybe_mps
    from hpdl.runtime.mps import daemon_pid
    from hpdl.runtime.procs import pid_alive

    exe = tmp_path / "nvidia-cuda-mps-control"
    exe.write_text(FAKE_MPS)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with _maybe_mps(True) as environ:
        pipe = environ["CUDA_MPS_PIPE_DIRECTORY"]
        pid = daemon_pid(pipe)
        assert pid is not None and pid_alive(pid)
        log = os.path.join(environ["CUDA_MPS_LOG_DIRECTORY"], "control.log")
        assert open(log).read().split() == ["-d"]
    assert not pid_alive(pid) and not os.path.exists(pipe)
    with _maybe_mps(False) as environ:
        assert environ == {}


def test_mps_missing_names_the_program(monkeypatch, tmp_path):
    from hpdl.runtime.launch import _maybe_mps
    from hpdl.runtime.mps import MpsConfigError

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MpsConfigError, match="nvidia-cuda-mps-control on PATH"):
        with _maybe_mps(True):
            pass


@pytest.mark.parametrize("argv, code, message", [
    # usage errors exit 2, from the parser or from the harness's checks before the run (docs/bench.md)
    (["--device", "cpu", "--ranks-per-gpu", "2"], 2, "--ranks-per-gpu needs --device cuda"),
    (["--device", "cuda", "--ranks-per-gpu", "0"], 2, "--ranks-per-gpu"),           # refused by the parser
    (["--device", "cuda", "--ranks-per-gpu", "4", "--tune", "t.json"], 2, "no tuning table is written"),
    (["--device", "cuda", "--ranks-per-gpu", "2", "--graph"], 2, "['native', 'direct', 'ring'] run over gloo"),
])
def test_bench_ranks_per_gpu_flags(argv, code, message, tmp_path):
    out = subprocess.run([sys.executable, "-m", "hpdl.cli", "bench", "allreduce", "--np", "4", *argv],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == code and message in out.stderr, (out.returncode, out.stderr[-500:])   # usage error


def _die_on_rank_one(ctx):
    if ctx.rank == 1:
        os._exit(3)
    return ctx.rank


def test_pool_with_a_dead_rank_is_broken():
    """A rank that died leaves the pool unusable: the next get_pool() starts a new one (it handed out a pool
    with a dead rank before)."""
    from hpdl.runtime import WorkerFailedError
    from hpdl.testing.pool import RankPool

    pool = RankPool(2, timeout=60)
    try:
        with pytest.raises(WorkerFailedError, match="rank 1"):
            pool.run(_die_on_rank_one)
        assert pool.broken
    finally:
        pool.close()


def _fake_mps(tmp_path, monkeypatch):
    """The fake control program on PATH; the pids of the daemons it starts are appended to the returned file."""
    exe = tmp_path / "bin" / "nvidia-cuda-mps-control"
    exe.parent.mkdir()
    exe.write_text(FAKE_MPS.replace('  exit 0\nfi', '  echo $! >> "$FAKE_MPS_RECORD"\n  exit 0\nfi', 1))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    record = tmp_path / "daemons"
    record.write_text("")
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_RECORD", str(record))
    return record


def _left_running(record) -> list[int]:
    from hpdl.runtime.procs import pid_alive

    pids = [int(x) for x in record.read_text().split()]
    assert pids, "the fake daemon was never started"
    alive = [p for p in pids if pid_alive(p)]
    for p in alive:   # do not leave the test's own fake daemons behind
        os.kill(p, 9)
    return alive


def test_mps_daemon_stopped_when_start_is_interrupted(tmp_path, monkeypatch):
    """Ctrl-C while ``start`` waits for the daemon to come up (after ``-d`` ran): it is quit, not left behind."""
    from hpdl.runtime import mps

    record = _fake_mps(tmp_path, monkeypatch)
    real, calls = mps.daemon_pid, []

    def interrupted(pipe_dir):
        calls.append(pipe_dir)
        if len(calls) == 2:   # the first wait for the pid file, after "-d" started the daemon
            raise KeyboardInterrupt
        return real(pipe_dir)

    monkeypatch.setattr(mps, "daemon_pid", interrupted)
    daemon = mps.MpsDaemon(tmp_path / "m")
    with pytest.raises(KeyboardInterrupt):
        daemon.start()
    assert _left_running(record) == []


def test_rank_pool_stops_mps_when_it_fails_before_the_ranks_answer(tmp_path, monkeypatch):
    """RankPool with mps=True: a failure (here Ctrl-C) between the daemon's start and the ranks' start, and ranks
    that fail at start-up (no CUDA on this machine), both leave no daemon running."""
    import hpdl.runtime.launch as launch
    from hpdl.runtime.errors import WorkerFailedError
    from hpdl.testing.pool import RankPool

    record = _fake_mps(tmp_path, monkeypatch)

    def interrupted():
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(launch, "free_port", interrupted)
        # held, as an interactive session's last traceback is: the half-made pool's frame stays alive, so its
        # MPS context is not finalised by garbage collection
        with pytest.raises(KeyboardInterrupt) as held:
            RankPool(2, timeout=60, device="cuda", ranks_per_gpu=2, mps=True)
    assert _left_running(record) == [] and held.tb is not None
    import multiprocessing.context as mpc

    real_start, started = mpc.SpawnProcess.start, []

    def start_then_interrupt(proc):   # Ctrl-C after the first rank started: the second one never starts
        if started:
            raise KeyboardInterrupt
        started.append(proc)
        real_start(proc)

    with monkeypatch.context() as m:
        m.setattr(mpc.SpawnProcess, "start", start_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            RankPool(2, timeout=60, device="cuda", ranks_per_gpu=2, mps=True)
    assert _left_running(record) == [] and not started[0].is_alive()
    if not torch.cuda.is_available():
        with pytest.raises(WorkerFailedError, match="torch.cuda.is_available"):
            RankPool(2, timeout=60, device="cuda", ranks_per_gpu=2, mps=True)
        assert _left_running(record) == []


def test_mps_argument_must_be_a_bool(tmp_path, monkeypatch):
    """``mps="false"`` is refused, not taken as true (it started a daemon for RankPool)."""
    from hpdl.testing.pool import RankPool

    record = _fake_mps(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="mps must be True, False or None"):
        RankPool(2, timeout=60, device="cuda", ranks_per_gpu=2, mps="false")
    with pytest.raises(ValueError, match="mps must be True, False or None"):
        spawn(_rank_facts, 2, device="cuda", ranks_per_gpu=2, mps="false")
    assert record.read_text() == ""   # no daemon was started


def test_ranks_the_gpus_cannot_hold_are_refused_before_starting(tmp_path, monkeypatch):
    """3 ranks at 2 a GPU on a one-GPU host: refused in the parent, naming rank 2 (not after starting the ranks
    and an MPS daemon, with rank 2 failing alone). The GPU count is this host's, faked here (no GPU)."""
    from hpdl.testing.pool import RankPool

    record = _fake_mps(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match=r"local rank 2 has no GPU: only 1 visible and ranks_per_gpu=2"):
        spawn(_rank_facts, 3, device="cuda", ranks_per_gpu=2, mps=True, timeout=30, job_timeout=60)
    with pytest.raises(RuntimeError, match=r"local rank 2 has no GPU: only 1 visible and ranks_per_gpu=2"):
        RankPool(3, timeout=30, device="cuda", ranks_per_gpu=2, mps=True)
    assert record.read_text() == ""   # nothing was started
