"""The application's side of a progress agent: :class:`AgentClient` (one connection per process) and
:class:`Agent`, which starts one agent per node of a group and stops them (a context manager).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client
from typing import Sequence

import numpy as np

from hpdl.offload import agent as agent_mod
from hpdl.offload import control as P
from hpdl.offload import shm
from hpdl.offload.errors import AgentError
from hpdl.runtime import env
from hpdl.runtime.procs import pid_alive

_CURRENT: list["AgentClient"] = []  # the client of the innermost started Agent of this process


class AgentClient:
    """A connection to the agent of this node: control requests, mailboxes, doorbell and liveness.

    Args:
        address: the agent's Unix socket path.
        authkey: the control channel's key (default: read from ``address + '.key'``).
        label: who we are, for the agent's errors ("rank 3").
        timeout: seconds to connect and to wait for each control reply.
    """

    def __init__(self, address: str, authkey: bytes | None = None, *, label: str = "client", timeout: float = 60.0,
                 slots: int = 256):
        import torch.multiprocessing  # noqa: F401 - registers CUDA IPC pickling for CUDA buffers sent to the agent

        self.address, self.timeout = address, timeout
        self.desc = agent_mod.describe("?", "?", address)
        if authkey is None:
            try:
                with open(address + ".key", "rb") as fh:
                    authkey = fh.read()
            except OSError as exc:
                raise AgentError(f"no offload agent at {address}: cannot read its key ({exc}); start one with "
                                 "`hpdl offload agent` or hpdl.offload.Agent", agent=self.desc) from None
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._conn = Client(address, family="AF_UNIX", authkey=authkey)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if time.monotonic() > deadline:
                    raise AgentError(f"cannot connect to the offload agent at {address}: {exc}",
                                     agent=self.desc) from None
                time.sleep(0.05)
        self._lock = threading.Lock()
        self._seq = 0
        self.closed = False
        self.mailboxes = shm.Mailboxes(slots, shared=True)
        w = self.request(P.Hello(label, os.getpid(), self.mailboxes.path, slots))
        self.agent, self.agents, self.pid = w.agent, w.agents, w.pid
        self.cores = tuple(w.cores)  # the agent's pinned cores (its native executor's), () if not pinned
        self.desc = agent_mod.describe(w.agent, w.pid, address)
        self.status = np.memmap(w.status_path, dtype=np.int64, mode="r", shape=(agent_mod.STATUS_WORDS,))
        self.bell = shm.RemoteBell(w.bell_path)
        # the native executor's doorbell: a futex word in the status block (see ring_native)
        self._native_bell = np.memmap(w.status_path, dtype=np.uint32, mode="r+", offset=agent_mod.BELL * 8,
                                      shape=(1,))
        self._bell_token = (os.getpid() << 12) & 0xFFFFFFFF
        self.closed = False

    def request(self, msg, timeout: float | None = None):
        """Send one control message and return the reply's value.

        Raises:
            AgentError: the agent replied with an error, hung up, or did not answer within ``timeout``.
        """
        timeout = self.timeout if timeout is None else timeout
        with self._lock:
            self._seq += 1
            seq = self._seq
            deadline = time.monotonic() + timeout
            try:
                self._conn.send((seq, msg))
                while True:  # replies to requests that timed out earlier arrive late: skip them
                    if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                        raise AgentError(f"{self.desc} did not answer {type(msg).__name__} within {timeout:.0f}s",
                                         agent=self.desc)
                    got, reply = self._conn.recv()
                    if got == seq:
                        break
            except (EOFError, OSError) as exc:
                raise AgentError(f"{self.desc} is gone ({type(exc).__name__}: {exc})", agent=self.desc) from None
        if not reply.ok:
            raise AgentError(f"{self.desc}: {reply.error}", agent=self.desc)
        return reply.value

    def ring_native(self) -> None:
        """Wake the agent's native executor: write a value no other client writes (so that a dispatcher about
        to sleep on the old value never misses it), then FUTEX_WAKE."""
        from hpdl.offload import native

        self._bell_token = (self._bell_token + 1) & 0xFFFFFFFF
        self._native_bell[0] = self._bell_token
        native.futex_wake(self._native_bell.ctypes.data, 1)

    def alive(self) -> bool:
        return pid_alive(self.pid) and self.status[agent_mod.STATE] != agent_mod.STOPPED

    def heartbeat_age(self) -> float:
        """Seconds since the agent's dispatcher last went round its loop."""
        return (time.monotonic_ns() - int(self.status[agent_mod.HEARTBEAT])) / 1e9

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._conn.close()
        except OSError:
            pass
        self.bell.close()


def connect(address: str | None = None, *, label: str | None = None, timeout: float = 60.0) -> AgentClient:
    """Connect this process to a running agent (``hpdl offload agent``) at ``address`` (default
    ``HPDL_OFFLOAD_AGENT``); later :func:`hpdl.offload.compile` calls use it. Returns the client.

    Raises:
        AgentError: no address given or set, or nobody answers there.
    """
    address = address or env.get("HPDL_OFFLOAD_AGENT")
    if not address:
        raise AgentError("no agent address: pass one or set HPDL_OFFLOAD_AGENT to the socket of "
                         "`hpdl offload agent`")
    c = AgentClient(address, label=label or f"pid {os.getpid()}", timeout=timeout)
    _CURRENT.append(c)
    return c


def current() -> AgentClient | None:
    """The agent client compile uses: the innermost started Agent, else a connection to HPDL_OFFLOAD_AGENT."""
    while _CURRENT and _CURRENT[-1].closed:
        _CURRENT.pop()
    if not _CURRENT and env.get("HPDL_OFFLOAD_AGENT"):
        connect()
    return _CURRENT[-1] if _CURRENT else None


class Agent:
    """Start one progress agent per node for the ranks of ``group`` (collective: every rank enters it).

    The lowest rank of each node spawns its node's agent (``python -m hpdl.offload.agent``), which joins the
    other agents' Gloo group; then every rank connects to its node's agent. While it runs,
    :func:`hpdl.offload.compile` executes plans on the agents. Leaving the block frees every request of its
    ranks and stops the agents.

        with hpdl.offload.Agent():
            req = hpdl.offload.compile(plan)
            req.start(); compute(); req.wait()

    Args:
        group: process group (None = world); its ranks' nodes come from hostnames or ``ranks_per_node``.
        ranks_per_node: emulate nodes of this many ranks on one host (tests): one agent per emulated node,
            talking to each other over Gloo as on separate hosts.
        threads: copy threads of each agent (the cores it may use; copies of 64 KiB or more run in parallel).
        spin_us: how long an agent keeps polling after activity before it sleeps on its doorbell.
        timeout: seconds for the agents' rendezvous and for transfers between agents (default HPDL_TIMEOUT).
        start_timeout: seconds an agent may take to start before every rank gets an :class:`AgentError`.
        reserve_cores: each rank takes the cores its agent's native executor is pinned to out of its own CPU
            affinity while the agent runs (restored by :meth:`stop`), as a DPU's cores are not the host's:
            the ranks' threads then never share a core with the agent's copies.

    Raises:
        AgentError: an agent did not start (its log's last lines are in the message) or cannot be reached.
        RuntimeError: torch.distributed is not initialised (no job to be collective over).
        ValueError: at construction, a bad ``threads``, ``spin_us``, ``timeout`` or ``start_timeout``, named.
    """

    def __init__(self, group=None, *, ranks_per_node: int | Sequence[int] | None = None, threads: int = 1,
                 spin_us: float | None = None, timeout: float | None = None, start_timeout: float = 120.0,
                 reserve_cores: bool = False):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1 (the agent's copy threads), got {threads!r}")
        for name, value, need in (("spin_us", spin_us, ">= 0 (microseconds)"), ("timeout", timeout, "> 0 (seconds)"),
                                  ("start_timeout", start_timeout, "> 0 (seconds)")):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or value < 0 or (value == 0 and name != "spin_us")):
                raise ValueError(f"{name} must be a number {need}, got {value!r}")
        self.group, self.ranks_per_node, self.threads = group, ranks_per_node, threads
        self.reserve_cores = reserve_cores
        self._affinity: set[int] | None = None  # this rank's CPU affinity before reserve_cores took cores out
        self.spin_us = float(env.get("HPDL_OFFLOAD_SPIN_US") if spin_us is None else spin_us)
        self.timeout = float(env.get("HPDL_TIMEOUT") if timeout is None else timeout)
        self.start_timeout = start_timeout
        self.client: AgentClient | None = None
        self.proc: subprocess.Popen | None = None
        self.address = ""

    @property
    def pid(self) -> int | None:
        """Pid of this node's agent."""
        return self.client.pid if self.client is not None else None

    def __enter__(self) -> "Agent":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(clean=exc_type is None)

    def start(self) -> "Agent":
        import torch.distributed as dist

        from hpdl.runtime.launch import free_port
        from hpdl.runtime.topology import discover

        if not dist.is_initialized():  # as compile(): say how to join a job, not torch's "default process group"
            raise RuntimeError("torch.distributed is not initialised: call hpdl.runtime.init_from_env() (torchrun, "
                               "mpirun, srun) or run under hpdl.runtime.spawn() before starting an Agent; it is "
                               "collective over the group")
        g = self.group
        rank = dist.get_rank(g)
        topo = discover(g, self.ranks_per_node)
        node = topo.node_of[rank]
        leader = min(topo.node_ranks(node))
        info = [None]
        if rank == 0:
            host = "127.0.0.1" if topo.single_node else os.environ.get("MASTER_ADDR", socket.gethostname())
            info = [(secrets.token_hex(4), host, free_port(), secrets.token_bytes(16))]
        dist.broadcast_object_list(info, src=dist.get_global_rank(g, 0) if g is not None else 0, group=g)
        job, host, port, key = info[0]
        self.address = os.path.join(tempfile.gettempdir(), f"hpdl-offload-{job}-{node}.sock")
        err = None
        if rank == leader:
            try:
                self._spawn(node, topo.num_nodes, f"{host}:{port}", key)
            except AgentError as exc:
                err = (str(exc), exc.agent)
        errs = [e for e in _gather(err, g) if e]
        if errs:
            self._kill()
            if self.proc is not None:
                self._log.close()
                if self.proc.returncode <= 0:  # killed by us: its log's tail is in the message already
                    _unlink(self.address + ".log")
                self.proc = None
            raise AgentError(errs[0][0], agent=errs[0][1])
        try:
            self.client = AgentClient(self.address, key, label=f"rank {rank}", timeout=self.timeout)
            err = None
        except AgentError as exc:
            err = (f"rank {rank}: {exc}", exc.agent)
        errs = [e for e in _gather(err, g) if e]
        if errs:
            self.stop(clean=False)
            raise AgentError(errs[0][0], agent=errs[0][1])
        _CURRENT.append(self.client)
        if self.reserve_cores and self.client.cores and hasattr(os, "sched_setaffinity"):
            mine = set(os.sched_getaffinity(0))
            left = mine - set(self.client.cores)
            if left and left != mine:
                self._affinity = mine
                os.sched_setaffinity(0, left)
        return self

    def _spawn(self, index: int, agents: int, rendezvous: str, key: bytes) -> None:
        log_path = self.address + ".log"
        cmd = [sys.executable, "-m", "hpdl.cli", "offload", "agent", "--index", str(index), "--agents", str(agents),
               "--rendezvous", rendezvous, "--address", self.address, "--threads", str(self.threads),
               "--timeout", str(self.timeout), "--spin-us", str(self.spin_us), "--parent-pid", str(os.getpid())]
        environ = dict(os.environ, **{agent_mod.AUTHKEY_ENV: key.hex()})
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=environ,
                                     stdin=subprocess.DEVNULL)
        who = agent_mod.describe(index, self.proc.pid, self.address)
        deadline = time.monotonic() + self.start_timeout
        status = self.address + ".status"
        while True:
            code = self.proc.poll()
            if code is not None:
                raise AgentError(f"{who} exited with code {code} while starting; its log:\n{_tail(log_path)}",
                                 agent=who)
            if os.path.exists(status):
                try:
                    st = np.memmap(status, dtype=np.int64, mode="r", shape=(agent_mod.STATUS_WORDS,))
                    if st[agent_mod.STATE] == agent_mod.READY:
                        return
                except (ValueError, OSError):
                    pass  # being created
            if time.monotonic() > deadline:
                self._kill()
                raise AgentError(f"{who} did not become ready within {self.start_timeout:g}s (a peer agent "
                                 f"missing from the rendezvous at {rendezvous}?); its log:\n{_tail(log_path)}",
                                 agent=who)
            time.sleep(0.02)

    def stop(self, clean: bool = True) -> None:
        """Free this rank's requests and stop the agents (collective when ``clean``; otherwise each leader
        stops its agent at once and the node's other ranks get AgentError from requests still running)."""
        import torch.distributed as dist

        c = self.client
        if c in _CURRENT:
            _CURRENT.remove(c)
        if self._affinity is not None:
            try:
                os.sched_setaffinity(0, self._affinity)
            except OSError:
                pass
            self._affinity = None
        if c is not None and self.proc is None:
            c.close()
        if clean and dist.is_initialized():
            _gather(None, self.group)  # the other ranks of the node are done with their agent
        if self.proc is not None:
            if c is not None and not c.closed:
                try:
                    c.request(P.Shutdown(), timeout=5.0)
                except AgentError:
                    pass
                c.close()
            try:
                code = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill()
                code = self.proc.returncode
            self._log.close()
            agent_mod.cleanup(self.address)  # a killed agent leaves its socket, status and doorbell behind
            if code is None or code <= 0:  # kept when the agent failed with an error of its own
                _unlink(self.address + ".log")
        if clean and dist.is_initialized():
            _gather(None, self.group)  # every agent is gone when stop() returns on any rank
        self.client = None
        self.proc = None

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc is not None:
            agent_mod.cleanup(self.address)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _gather(value, group) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, "rb") as fh:
            return b"\n".join(fh.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return "(no log)"
