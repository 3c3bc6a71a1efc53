"""The progress agent: one process per node, in the role of a DPU's cores.

It maps the registered buffers of every rank of its node (POSIX shared memory; CUDA IPC for GPU tensors),
runs their started plans on one :class:`~hpdl.offload.executor.Executor` (messages between ranks of the node
are single copies from the sender's buffer into the receiver's), moves data between nodes over a Gloo group
of all agents (:class:`hpdl.comm.transport.gloo.GlooTransport`), and signals completion through the ranks' mailboxes.

Started by :class:`hpdl.offload.Agent` (one per node of a group) or by ``hpdl offload agent`` (one per node
of a job). Files next to its Unix socket ``PATH``: ``PATH.status`` (pid, heartbeat, state), ``PATH.bell``
(doorbell FIFO), ``PATH.key`` (the control channel's key, mode 0600).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import tempfile
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Listener

import numpy as np

log = logging.getLogger("hpdl.offload.agent")

# status block words (BELL: low 32 bits are the native executor's doorbell futex)
PID, HEARTBEAT, STATE, INDEX, AGENTS, BELL = range(6)
STATUS_WORDS = 8
STARTING, READY, STOPPED = 0, 1, 2
KEY_COUNTER = "hpdl_offload_plan_key"
AUTHKEY_ENV = "HPDL_OFFLOAD_AUTHKEY"


def exit_key(index: int) -> str:
    """Store key where agent ``index`` says why it stopped when a rank's death stopped it."""
    return f"hpdl_offload_agent{index}_exit"


def describe(index: int, pid: int | str = "?", address: str = "") -> str:
    """How errors name an agent: ``offload agent 1 (pid 4242, /tmp/hpdl-offload-ab-1.sock)``."""
    return f"offload agent {index} (pid {pid}{', ' + address if address else ''})"


class _Server:
    def __init__(self, index: int, agents: int, address: str, authkey: bytes, store, threads: int,
                 spin_us: float, parent_pid: int | None, transport):
        import torch

        import hpdl.offload.executor as ex
        from hpdl.offload import shm

        torch.set_num_threads(1)  # parallel copies run on the executor's copy threads, one core each
        self.index, self.agents, self.address, self.store = index, agents, address, store
        self.parent_pid = parent_pid
        self.status = np.memmap(address + ".status", dtype=np.int64, mode="w+", shape=(STATUS_WORDS,))
        self.status[PID], self.status[INDEX], self.status[AGENTS] = os.getpid(), index, agents
        self.bell = shm.Bell(fifo=address + ".bell")
        self.executor = ex.Executor(bell=self.bell, spin_us=spin_us, copy_threads=threads,
                                    name=f"hpdl-offload-agent{index}")
        self.executor.heartbeat = self._beat
        self.native = None
        from hpdl.offload import native

        lib = native.load()  # None (logged once) without a compiler: every plan runs on the Python executor
        if lib is not None:
            cpus = native.default_cpus(threads, index)
            self.native = native.NativeEngine(lib, self.status.ctypes.data + BELL * 8, threads=threads, cpus=cpus,
                                              spin_us=spin_us)
            log.info("agent %d: native executor, %d thread(s), cores %s", index, threads, cpus or "not pinned")
        self.transport = transport
        self.mapper = shm.Mapper()
        self.listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self._last_beat = self._last_parent_check = 0
        self.labels: dict[int, str] = {}  # client pid -> its label ("rank 3"), to name a parent that died

    def _beat(self) -> None:
        now = time.monotonic_ns()
        if now - self._last_beat < 1_000_000:
            return
        self._last_beat = now
        self.status[HEARTBEAT] = now
        if self.parent_pid and now - self._last_parent_check > 1_000_000_000:
            from hpdl.runtime.procs import pid_alive

            self._last_parent_check = now
            if not pid_alive(self.parent_pid):  # the rank that started us died: nobody will stop us
                log.warning("agent %d: parent %d is gone, stopping", self.index, self.parent_pid)
                who = self.labels.get(self.parent_pid, "the rank that started it")
                try:  # before our connections close: other agents blame that rank, not this agent
                    self.store.set(exit_key(self.index), f"{who} (pid {self.parent_pid}) on {socket.gethostname()} "
                                                         "died")
                except Exception:  # noqa: BLE001 - the store may be gone too
                    pass
                self.executor.request_stop()

    def serve(self) -> None:
        threading.Thread(target=self._accept, name="hpdl-offload-accept", daemon=True).start()
        self.status[HEARTBEAT] = time.monotonic_ns()
        self.status[STATE] = READY
        self.status.flush()
        try:
            self.executor.run()
        finally:
            self.status[STATE] = STOPPED
            self.listener.close()
            if self.native is not None:
                self.native.close()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError):
                if self.executor.stopping:
                    return
                continue  # a client that failed authentication or hung up during the handshake
            except Exception:  # noqa: BLE001 - e.g. AuthenticationError: keep serving the others
                continue
            threading.Thread(target=self._client, args=(conn,), name="hpdl-offload-client", daemon=True).start()

    def _free(self, inst, reason: str) -> None:
        if isinstance(inst, tuple):  # ("native", engine id)
            self.native.free(inst[1], reason)
        else:
            self.executor.free(inst, reason)

    def _client(self, conn) -> None:
        from hpdl.offload import native as native_mod
        from hpdl.offload import control as P
        from hpdl.offload import shm
        from hpdl.offload.executor import Instance

        boxes, label, insts = None, "client", {}
        try:
            while True:
                try:
                    item = conn.recv()
                except (EOFError, OSError):
                    return
                seq, msg = item if isinstance(item, tuple) and len(item) == 2 else (None, item)
                try:
                    if isinstance(msg, P.Hello):
                        boxes = shm.Mailboxes(msg.slots, path=msg.mailbox_path)
                        label = msg.label
                        self.labels[msg.pid] = label
                        value = P.Welcome(self.index, self.agents, os.getpid(), socket.gethostname(),
                                          self.address + ".status", self.address + ".bell",
                                          tuple(self.native.cpus) if self.native is not None else ())
                    elif isinstance(msg, P.NewKey):
                        value = int(self.store.add(KEY_COUNTER, 1))
                    elif isinstance(msg, P.Register):
                        paths, tensors = [], {}
                        try:
                            for n, h in msg.buffers.items():
                                if isinstance(h, shm.ShmHandle):
                                    tensors[n] = self.mapper.tensor(h)
                                    paths.append(h.path)
                                else:
                                    tensors[n] = h
                            inst = Instance(msg.plan, tensors, boxes.array, msg.slot, self.transport, "agent",
                                            f"{label} (rank {msg.plan.rank} of the plan's group)")
                            if msg.ready_event is not None:
                                import torch

                                dev, handle = msg.ready_event
                                inst.ready_event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", dev),
                                                                                    handle)
                            if (self.native is not None and msg.native
                                    and native_mod.eligible(msg.plan, tensors) is None):
                                inst = ("native", self.native.register(inst))
                                value = "native"
                            else:
                                self.executor.register(inst)
                                value = None
                        except BaseException:
                            self.mapper.release(paths)
                            raise
                        insts[msg.slot] = (inst, paths)
                    elif isinstance(msg, P.Free):
                        inst, paths = insts.pop(msg.slot, (None, ()))
                        if inst is not None:
                            self._free(inst, "freed its request")
                        self.mapper.release(paths)
                        value = None
                    elif isinstance(msg, P.Query):
                        inst = insts.get(msg.slot, (None,))[0]
                        value = None if inst is None else self.native.status(inst[1]) if isinstance(inst, tuple) \
                            else self.executor.call(inst.status)
                    elif isinstance(msg, P.Shutdown):
                        conn.send((seq, P.Reply(True)))
                        self.executor.request_stop()
                        return
                    else:
                        raise TypeError(f"unknown message {type(msg).__name__}")
                    conn.send((seq, P.Reply(True, value)))
                    # drop this frame's references: a freed plan's tensors must not keep its files mapped
                    inst = tensors = value = msg = item = None
                except (EOFError, OSError, BrokenPipeError):
                    return
                except Exception as exc:  # noqa: BLE001 - the client gets the error, the agent serves on
                    try:
                        conn.send((seq, P.Reply(False, error=f"{type(exc).__name__}: {exc}")))
                    except OSError:
                        return
        finally:  # a client that left (or died) takes its requests with it
            for inst, paths in insts.values():
                try:
                    self._free(inst, "left (its process ended or disconnected)")
                except Exception:  # noqa: BLE001 - best effort while the agent may be stopping
                    pass
                self.mapper.release(paths)
            conn.close()
            try:
                shm.sweep()  # the files of a client that was killed
            except Exception:  # noqa: BLE001 - cleanup must not take the agent down
                log.exception("agent %d: sweeping shared memory failed", self.index)


def cleanup(address: str) -> None:
    """Remove an agent's socket, status block, doorbell and key file."""
    for suffix in ("", ".status", ".bell", ".key"):
        try:
            os.unlink(address + suffix)
        except OSError:
            pass


SUFFIXES = ("", ".status", ".bell", ".key", ".log")


def sweep_stale(directory: str | None = None, *, min_age_s: float = 60.0) -> list[str]:
    """Remove the files of agents that are gone: sockets ``hpdl-offload-*.sock`` and their ``.status``,
    ``.bell``, ``.key`` and ``.log`` files, left behind when a job (or its agent) was killed.

    An agent is gone when its status block names a pid that no longer runs, or, without a status block, when
    nobody accepts connections on its socket and its files are older than ``min_age_s`` (an agent that is
    still starting has written no status yet). Files of live agents are never touched. Returns the paths
    removed.
    """
    from hpdl.runtime.procs import pid_alive

    d = directory or tempfile.gettempdir()
    try:
        names = os.listdir(d)
    except OSError:
        return []
    bases = set()
    for n in names:
        if n.startswith("hpdl-offload-") and ".sock" in n:
            base = n[:n.index(".sock") + len(".sock")]
            if n[len(base):] in SUFFIXES:
                bases.add(base)
    removed = []
    now = time.time()
    for base in sorted(bases):
        address = os.path.join(d, base)
        try:
            st = np.fromfile(address + ".status", dtype=np.int64, count=STATUS_WORDS)
        except (OSError, ValueError):
            st = None
        if st is not None and len(st) == STATUS_WORDS and st[PID] > 0:
            if pid_alive(int(st[PID])):
                continue
        else:
            ages = [now - os.path.getmtime(address + s) for s in SUFFIXES if os.path.exists(address + s)]
            if not ages or min(ages) < min_age_s or _accepts(address):
                continue
        for suffix in SUFFIXES:
            try:
                os.unlink(address + suffix)
                removed.append(address + suffix)
            except OSError:
                pass
    return removed


def _accepts(address: str) -> bool:
    """Whether a process listens on the Unix socket ``address``."""
    if not os.path.exists(address):
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(address)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _refuse_live(address: str, index: int) -> None:
    """Raise AgentError when a running agent already serves ``address`` (another job on this host with the
    same path): starting would delete its socket, key and doorbell under it."""
    from hpdl.offload.errors import AgentError
    from hpdl.runtime.procs import pid_alive

    try:
        st = np.fromfile(address + ".status", dtype=np.int64, count=STATUS_WORDS)
    except (OSError, ValueError):
        return
    if len(st) == STATUS_WORDS and st[PID] > 0 and st[STATE] != STOPPED and pid_alive(int(st[PID])) \
            and int(st[PID]) != os.getpid():
        who = describe(int(st[INDEX]), int(st[PID]), address)
        raise AgentError(f"cannot start offload agent {index} at {address}: {who} serves it already (another "
                         "job on this host?); pass another --address (or HPDL_OFFLOAD_AGENT)", agent=who)


def run_agent(*, index: int, agents: int, rendezvous: str, address: str, authkey: bytes | None = None,
              threads: int = 1, timeout: float = 300.0, spin_us: float = 50.0,
              parent_pid: int | None = None, on_ready=None) -> int:
    """Run an agent until it is shut down (a ``Shutdown`` message, SIGTERM/SIGINT, or its parent's death).

    Args:
        index, agents: this agent's number and how many there are (one per node).
        rendezvous: ``host:port`` of agent 0's store (agent 0 listens there).
        address: path of the Unix socket ranks connect to.
        authkey: key of the control channel (default: random, written to ``address + '.key'``, mode 0600).
        threads: copy threads (the DPU cores it may use); copies of 64 KiB or more run on them in parallel.
        timeout: seconds the rendezvous and transfers between agents may wait.
    """
    import torch.distributed as dist

    from hpdl.comm.transport.gloo import GlooTransport

    _refuse_live(address, index)
    cleanup(address)
    try:
        sweep_stale(os.path.dirname(os.path.abspath(address)))  # files of agents killed in earlier jobs
    except Exception:  # noqa: BLE001 - cleaning up after others must never stop this agent
        log.exception("agent %d: sweeping stale agent files failed", index)
    # the status block names this pid from the start (state STARTING): the rendezvous may wait minutes for
    # the other nodes' agents, and without it another job's sweep_stale took the key for a dead agent's
    st = np.memmap(address + ".status", dtype=np.int64, mode="w+", shape=(STATUS_WORDS,))
    st[PID], st[INDEX], st[AGENTS], st[STATE] = os.getpid(), index, agents, STARTING
    st.flush()
    del st
    authkey = authkey or secrets.token_bytes(16)
    fd = os.open(address + ".key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(authkey)
    host, _, port = rendezvous.rpartition(":")
    try:
        store = dist.TCPStore(host, int(port), agents, is_master=(index == 0),
                              timeout=timedelta(seconds=timeout), wait_for_workers=True)
        store.set(f"hpdl_offload_agent{index}", f"{os.getpid()} {socket.gethostname()}")
        peers = [store.get(f"hpdl_offload_agent{e}").decode().split(" ", 1) for e in range(agents)]
        transport = GlooTransport.create(store, index, agents, timeout, prefix="hpdl-offload",
                                         describe=lambda e: f"{describe(e, peers[e][0])} on {peers[e][1]}",
                                         explain=lambda e: store.get(exit_key(e)).decode()
                                         if store.check([exit_key(e)]) else None)
    except Exception as exc:  # noqa: BLE001 - whatever the rendezvous raised, say which agent and where
        cleanup(address)
        from hpdl.offload.errors import AgentError

        who = describe(index, os.getpid(), address)
        raise AgentError(f"{who}: rendezvous of {agents} agents at {rendezvous} failed within {timeout:.0f}s: "
                         f"{type(exc).__name__}: {exc}", agent=who) from None
    server = _Server(index, agents, address, authkey, store, threads, spin_us, parent_pid, transport)

    def _stop(signum, frame):
        server.executor.request_stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if on_ready is not None:
        on_ready(describe(index, os.getpid(), address))
    try:
        server.serve()
    finally:
        cleanup(address)
    if parent_pid:  # started by hpdl.offload.Agent and stopped cleanly: its log (address.log) holds nothing
        try:
            os.unlink(address + ".log")
        except OSError:
            pass
    return 0
