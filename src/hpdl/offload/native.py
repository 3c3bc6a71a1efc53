"""The native executor: a node's intra-node plans flattened once into arrays and run by C threads.

:func:`load` builds ``native_engine.c`` with the system C compiler into ``~/.cache/hpdl/offload-engine-<hash>/``
(once per machine and source version, like hpdl.comm's CUDA kernels; a plain ``gcc -shared`` build of one
torch-free file takes about a second where ``torch.utils.cpp_extension`` would compile torch's headers for
~40 s) and loads it with ctypes. :class:`NativeEngine` registers requests with it: each operation becomes
its kind, dependency count, users and byte segments (absolute addresses of the agent's mappings of the
ranks' shared-memory buffers); each message between two ranks of the node one list of segments straight
from the sender's box into the receiver's. The engine's dispatcher and workers are pthreads (the GIL is never
taken), pinned to the agent's reserved cores, woken by futexes, and complete a request by writing its
mailbox and waking the rank's futex.

Where no compiler exists, or ``HPDL_OFFLOAD_NATIVE=0``, :func:`load` returns None (one log line says why)
and agents use the Python :class:`~hpdl.offload.executor.Executor`; so does every plan the engine cannot run
(messages to other nodes, CUDA buffers, reductions of other dtypes than float32/float64/int32/int64).

The futex helpers (:func:`futex_wait`, :func:`futex_wake`) need no compiler: they call libc's ``syscall``
through ctypes (which releases the GIL), so ranks block in ``wait()`` instead of spinning whatever runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from hpdl.offload import shm
from hpdl.offload.errors import OffloadError
from hpdl.offload.status import Pending, Status
from hpdl.runtime import env

log = logging.getLogger("hpdl.offload")

_SOURCE = Path(__file__).with_name("native_engine.c")
K_COPY, K_REDUCE, K_HALF, K_NOP = range(4)
S_IDLE, S_DEPS, S_MATCH, S_RUN, S_DONE = range(5)
DTYPES = {"float32": 0, "float64": 1, "int32": 2, "int64": 3}
REDOPS = {"sum": 0, "prod": 1, "min": 2, "max": 3}
SEQ = 6  # mailbox word whose low 32 bits are the rank's futex (bumped after DONE or FAILED)
BELL = 5  # status-block word whose low 32 bits are the native engine's doorbell futex

# ---- futexes through libc (no compiler needed) ----------------------------------------------------------
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # not glibc-like: no futexes, callers fall back to polling
    _syscall = None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_ok() -> bool:
    """Whether :func:`futex_wait`/:func:`futex_wake` work here (Linux on x86-64 or aarch64)."""
    return _syscall is not None and _SYS_FUTEX is not None


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Block (GIL released) while the 32-bit word at ``addr`` holds ``expected``, at most ``timeout_s``,
    until a :func:`futex_wake` on it (shared futex: works across processes on a shared mapping)."""
    sec = int(timeout_s)
    ts = _Timespec(sec, int((timeout_s - sec) * 1e9))
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
             ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), None, ctypes.c_int(0))


def futex_wake(addr: int, n: int = 2 ** 31 - 1) -> None:
    """Wake up to ``n`` waiters of the 32-bit word at ``addr``."""
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(n),
             None, None, ctypes.c_int(0))


def seq_address(mailbox: np.ndarray, slot: int) -> int:
    """Address of the futex word of ``slot`` in a mailbox array (``[slots, SLOT_WORDS]`` int64)."""
    return mailbox.ctypes.data + (slot * shm.SLOT_WORDS + SEQ) * 8


def signal(mailbox: np.ndarray, slot: int) -> None:
    """Bump ``slot``'s futex word and wake its waiting rank (call after writing DONE or FAILED). One executor
    serves a slot, so the increment needs no atomic."""
    words = mailbox.view(np.uint32)
    col = 2 * SEQ  # low half of the int64 word on a little-endian host
    words[slot, col] = (int(words[slot, col]) + 1) & 0xFFFFFFFF
    if futex_ok():
        futex_wake(seq_address(mailbox, slot))


# ---- building the engine ---------------------------------------------------------------------------------
_LOCK = threading.Lock()
_LIB: list = []  # [ctypes.CDLL or None] once tried


class NativeUnavailable(OffloadError):
    """The native executor cannot be built or loaded here (the message says why)."""


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/hpdl`` (default ``~/.cache/hpdl``), where hpdl.comm's kernels are built too."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(root) / "hpdl"


def build(verbose: bool = False) -> Path:
    """Compile the engine (once per source version and compiler) and return the shared library's path.

    Raises:
        NativeUnavailable: no C compiler, or the build failed (its output is in the message).
    """
    code = _SOURCE.read_bytes()
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        raise NativeUnavailable("no C compiler: neither $CC, gcc nor cc is on PATH")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"{cc} does not run: {exc}") from None
    tag = hashlib.sha1(code + version + platform.machine().encode()).hexdigest()[:16]
    for root in (cache_dir(), Path(tempfile.gettempdir()) / f"hpdl-cache-{os.getuid()}"):
        out = root / f"offload-engine-{tag}" / "engine.so"
        if out.exists():
            return out
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        tmp = out.with_name(f".engine-{os.getpid()}-{threading.get_ident()}.so")
        cmd = [cc, "-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-o", str(tmp), str(_SOURCE)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise NativeUnavailable(f"building the native offload engine failed ({' '.join(cmd)}):\n"
                                    f"{proc.stdout}{proc.stderr}")
        if verbose:
            log.info("built %s", out)
        os.replace(tmp, out)  # atomic: concurrent builders each write their own file, one wins
        return out
    raise NativeUnavailable(f"no writable cache directory ({cache_dir()} or the temp directory)")


def load() -> ctypes.CDLL | None:
    """The engine library, built on first use; None (and one log line saying why, the Python executor is
    used) when ``HPDL_OFFLOAD_NATIVE`` is 0/off or it cannot be built.

    Raises:
        NativeUnavailable: ``HPDL_OFFLOAD_NATIVE=1`` (required) and it cannot be built or loaded.
        ValueError: ``HPDL_OFFLOAD_NATIVE`` is none of auto, 1/on/true/yes, 0/off/false/no.
    """
    want = str(env.get("HPDL_OFFLOAD_NATIVE")).strip().lower()
    if want not in ("", "auto", "1", "on", "true", "yes", "0", "off", "false", "no"):   # not silently auto
        raise ValueError(f"HPDL_OFFLOAD_NATIVE must be auto, 1 (required) or 0 (off), got {want!r}")
    if want in ("0", "off", "false", "no"):
        return None
    with _LOCK:
        if not _LIB:
            try:
                if not futex_ok():
                    raise NativeUnavailable(f"no futexes on {platform.system()} {platform.machine()}")
                lib = ctypes.CDLL(str(build()))
                _declare(lib)
                _LIB.append(lib)
            except (NativeUnavailable, OSError) as exc:
                _LIB.append(exc)
                log.warning("hpdl.offload: native executor unavailable (%s); using the Python executor",
                            str(exc).splitlines()[0])
        got = _LIB[0]
    if isinstance(got, BaseException):
        if want in ("1", "on", "true", "yes"):
            raise NativeUnavailable(f"HPDL_OFFLOAD_NATIVE={want} but the native executor is unavailable: {got}")
        return None
    return got


def _declare(lib) -> None:
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.hpe_create.argtypes = [I, P, I, L, L, P]
    lib.hpe_create.restype = P
    lib.hpe_destroy.argtypes = [P]
    lib.hpe_ring.argtypes = [P]
    lib.hpe_add_inst.argtypes = [P, P, I, P, P, I, P, I]
    lib.hpe_add_inst.restype = I
    lib.hpe_add_match.argtypes = [P, I, I, I, I, P, I]
    lib.hpe_add_match.restype = I
    lib.hpe_remove_inst.argtypes = [P, I, P, I]
    lib.hpe_remove_inst.restype = I
    lib.hpe_fail.argtypes = [P, I]
    lib.hpe_query.argtypes = [P, I, P, P]
    lib.hpe_query.restype = I
    lib.hpe_stats.argtypes = [P, P]


# ---- flattening ------------------------------------------------------------------------------------------
def _runs(v: torch.Tensor) -> tuple[np.ndarray, int]:
    """The contiguous byte runs of a strided CPU view in C order: (start addresses, bytes per run)."""
    es = v.element_size()
    dims = [(n, s) for n, s in zip(v.shape, v.stride()) if n != 1]
    run = 1
    k = len(dims)
    while k and dims[k - 1][1] == run:
        run *= dims[k - 1][0]
        k -= 1
    offs = np.zeros(1, dtype=np.int64)
    for n, s in dims[:k]:
        offs = (offs[:, None] + np.arange(n, dtype=np.int64) * s).ravel()
    return v.data_ptr() + offs * es, run * es


def segments(dst: torch.Tensor, src: torch.Tensor) -> np.ndarray:
    """``[n, 3]`` int64 (src address, dst address, bytes) moving ``src``'s elements onto ``dst``'s in C
    order (the executor's copy semantics: equal element counts, any shapes), merged where both sides are
    contiguous."""
    total = src.numel() * src.element_size()
    if total == 0:
        return np.zeros((0, 3), dtype=np.int64)
    sa, sl = _runs(src)
    da, dl = _runs(dst)
    g = math.gcd(sl, dl)
    pos = np.arange(0, total, g, dtype=np.int64)
    s = sa[pos // sl] + pos % sl
    d = da[pos // dl] + pos % dl
    start = np.ones(len(pos), dtype=bool)
    start[1:] = (s[1:] != s[:-1] + g) | (d[1:] != d[:-1] + g)
    idx = np.flatnonzero(start)
    n = np.diff(np.append(idx, len(pos))) * g
    return np.stack([s[idx], d[idx], n], axis=1).astype(np.int64)


def eligible(plan, tensors: dict[str, torch.Tensor]) -> str | None:
    """None when the engine can run ``plan`` (a rank's CompiledPlan) on ``tensors``, else why not."""
    if len(set(plan.endpoints)) != 1:
        return "messages to other nodes"
    if any(t.is_cuda or t.device.type != "cpu" for t in tensors.values()):
        return "non-CPU buffers"
    for c in plan.ops:
        if c.kind == "reduce" and plan.buffer(c.dst.buffer).dtype not in DTYPES:
            return f"reduction of {plan.buffer(c.dst.buffer).dtype}"
        if c.kind == "reduce" and c.reduce_op not in REDOPS:
            return f"reduction op {c.reduce_op}"
    return None


class _Native:
    __slots__ = ("inst", "id", "error", "keys")

    def __init__(self, inst, id_):
        self.inst, self.id, self.error, self.keys = inst, id_, None, []


class NativeEngine:
    """The engine of one agent: requests in, pthreads running them.

    Args:
        bell_address: address of the 32-bit doorbell futex (the agent's status-block word :data:`BELL`).
        threads: threads that copy (the dispatcher and ``threads - 1`` workers).
        cpus: cores to pin them to (dispatcher first); empty: not pinned.
        spin_us: microseconds the dispatcher and workers poll after activity before sleeping on their futexes.
        parallel_min_bytes: a pass copies on the workers too from this many bytes.
    """

    def __init__(self, lib, bell_address: int, *, threads: int = 1, cpus=(), spin_us: float = 50.0,
                 parallel_min_bytes: int = 256 * 1024):
        self.lib = lib
        cpu_arr = (ctypes.c_int32 * max(1, len(cpus)))(*cpus) if cpus else (ctypes.c_int32 * 1)(-1)
        self._cpus = cpu_arr
        self.handle = lib.hpe_create(max(0, threads - 1), cpu_arr, len(cpus), int(spin_us * 1000),
                                     int(parallel_min_bytes), ctypes.c_void_p(bell_address))
        self.cpus = tuple(cpus)
        self._lock = threading.Lock()
        self._natives: dict[int, _Native] = {}          # engine id -> record
        self._halves: dict[tuple, dict[str, tuple]] = {}  # (scope, key, message) -> {"send"/"recv": (id, op)}
        self._gone: dict[tuple, str] = {}  # message key -> who unregistered its half, and why (for the other's error)

    def ring(self) -> None:
        if self.handle:
            self.lib.hpe_ring(self.handle)

    def close(self) -> None:
        with self._lock:  # no call may reach the library once its engine is destroyed
            if self.handle:
                self.lib.hpe_destroy(self.handle)
                self.handle = None

    def register(self, inst) -> int:
        """Register an :class:`~hpdl.offload.executor.Instance` (built for its checks and buffer views);
        returns its engine id. Its messages' other halves may register before or after it."""
        plan = inst.plan
        desc = np.zeros((len(inst.ops), 8), dtype=np.int32)
        users, segs = [], []
        nseg = 0
        for o, c in zip(inst.ops, plan.ops):
            row = desc[o.index]
            row[1] = len(c.deps)
            row[2], row[3] = len(o.users), len(users)
            users.extend(o.users)
            if not o.numel:
                row[0] = K_NOP
            elif c.kind in ("copy", "reduce"):
                sg = segments(o.dst, o.src)
                row[0] = K_COPY if c.kind == "copy" else K_REDUCE
                row[4], row[5] = nseg, len(sg)
                segs.append(sg)
                nseg += len(sg)
                if c.kind == "reduce":
                    row[6] = DTYPES[plan.buffer(c.dst.buffer).dtype]
                    row[7] = REDOPS[c.reduce_op]
            else:
                row[0] = K_HALF
        users_arr = np.asarray(users or [0], dtype=np.int32)
        segs_arr = np.concatenate(segs) if segs else np.zeros((1, 3), dtype=np.int64)
        segs_arr = np.ascontiguousarray(segs_arr, dtype=np.int64)
        row_addr = inst.mailbox.ctypes.data + inst.slot * shm.SLOT_WORDS * 8
        with self._lock:
            if not self.handle:
                raise OffloadError(f"{inst.label}: the native executor is stopped")
            id_ = self.lib.hpe_add_inst(self.handle, ctypes.c_void_p(row_addr), len(inst.ops),
                                        desc.ctypes.data, users_arr.ctypes.data, len(users), segs_arr.ctypes.data,
                                        nseg)
            rec = self._natives[id_] = _Native(inst, id_)
            for o, c in zip(inst.ops, plan.ops):
                if c.kind not in ("send", "recv") or not o.numel:
                    continue
                k = (inst.scope, plan.key, c.message)
                rec.keys.append(k)
                halves = self._halves.setdefault(k, {})
                halves[c.kind] = (id_, o.index)
                if "send" in halves and "recv" in halves:
                    (si, so), (ri, ro) = halves["send"], halves["recv"]
                    sg = np.ascontiguousarray(segments(self._natives[ri].inst.ops[ro].dst,
                                                       self._natives[si].inst.ops[so].src), dtype=np.int64)
                    self.lib.hpe_add_match(self.handle, si, so, ri, ro, sg.ctypes.data, len(sg))
        return id_

    def free(self, id_: int, reason: str = "freed its request") -> None:
        """Unregister; requests waiting for one of its messages fail at once, naming its rank and ``reason``."""
        with self._lock:
            rec = self._natives.pop(id_, None)
            if rec is None or not self.handle:
                return
            orphans = (ctypes.c_int32 * 256)()
            n = self.lib.hpe_remove_inst(self.handle, id_, orphans, 256)
            for k in rec.keys:
                halves = self._halves.get(k, {})
                for side in [s for s, v in halves.items() if v[0] == id_]:
                    del halves[side]
                if halves:  # the other half stays: its request's error names this rank (it may start later)
                    self._gone[k] = f"{rec.inst.label} {reason}"
                else:
                    self._halves.pop(k, None)
                    self._gone.pop(k, None)
            for j in range(min(n, 256)):
                other = self._natives.get(orphans[j])
                if other is not None and other.error is None:
                    other.error = (f"{other.inst.label} plan {other.inst.plan.name!r} cannot complete: "
                                   f"{rec.inst.label} {reason} while this request waited for one of its messages")
                    log.warning("%s", other.error)

    def status(self, id_: int):
        """The :class:`~hpdl.offload.status.Status` of a request (error, outstanding operations)."""
        with self._lock:
            rec = self._natives.get(id_)
            if rec is None or not self.handle:
                return None
            n = len(rec.inst.ops)
            states = np.zeros(max(1, n), dtype=np.int8)
            counts = np.zeros(max(1, n), dtype=np.int32)
            flags = self.lib.hpe_query(self.handle, id_, states.ctypes.data, counts.ctypes.data)
            gone = next((self._gone[k] for k in rec.keys if k in self._gone), None)
        error = rec.error
        if flags & 2 and error is None:
            error = (f"{rec.inst.label} plan {rec.inst.plan.name!r} cannot complete: "
                     f"{gone or 'the request of a matching half is not registered'}; its half of a message "
                     "will never come")
        pending = []
        if flags & 1:
            for o in rec.inst.ops:
                st = int(states[o.index])
                if st == S_DONE:
                    continue
                what = (f"waits for {int(counts[o.index])} dependencies" if st == S_DEPS and counts[o.index] else
                        f"waits for rank {o.peer}'s matching half" if st == S_MATCH else
                        "being copied" if st == S_RUN else "ready")
                pending.append(Pending(o.describe(), o.peer, what))
        return Status(error, None, tuple(pending))

    def stats(self) -> dict:
        out = (ctypes.c_int64 * 5)()
        if self.handle:
            self.lib.hpe_stats(self.handle, out)
        return {"passes": out[0], "wakeups": out[1], "parallel_jobs": out[2], "bytes": out[3], "pieces": out[4]}


def default_cpus(threads: int, index: int = 0) -> list[int]:
    """Cores for an agent's ``threads``: ``HPDL_OFFLOAD_CORES`` (comma-separated) if set, else the last
    ``threads`` of this process's cores (shifted by ``index`` agents on one host) when at least as many are
    left for the ranks; else none (not pinned).

    Raises:
        ValueError: ``HPDL_OFFLOAD_CORES`` holds something else than core numbers of this host.
    """
    text = str(env.get("HPDL_OFFLOAD_CORES")).strip()
    if text:
        try:
            cores = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"HPDL_OFFLOAD_CORES must be comma-separated core numbers, got {text!r}") from None
        n = os.cpu_count() or 1
        bad = [c for c in cores if not 0 <= c < n]
        if bad:   # the engine would pin nothing (silently) while reserve_cores took them from the ranks
            raise ValueError(f"HPDL_OFFLOAD_CORES: {bad} are not cores of this host (0..{n - 1}), got {text!r}")
        return cores
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []
    if len(cores) < 2 * threads * (index + 1):
        return []
    end = len(cores) - threads * index
    return cores[end - threads:end]
