"""Naming the rank behind a failed collective: a post-mortem over the job's key-value store.

A rank's own wait only knows whom *it* waited for. In a ring, or in the two-level all-reduce's inter-node
phase, that is often a live rank that is itself stuck behind the real culprit, and a killed peer surfaces as
gloo's ``Connection closed by peer`` from whichever socket broke first (in cascades a survivor that already
exited). So when a collective fails, every rank that saw the failure writes a report under
``hpdl/fail/<group>/<call>/<rank>`` into the store torch.distributed was initialised with (a TCPStore: it
does not depend on the process group's sockets), then polls the reports of the others for a short window:

* a rank whose process is gone (same host: its pid, published once per group at first use) and that wrote
  no report is a dead peer -> :class:`~hpdl.runtime.errors.PeerFailedError` naming it, at once;
* ranks that wrote no report within the window are stopped, killed on another host, or never called the
  collective -> :class:`~hpdl.runtime.errors.CollectiveTimeoutError` naming them;
* when every rank reported (all saw the failure, none is missing) the original error stands.

A rank that reported and then exited (it raised first) is not blamed. Without a store (an MPI launch) the
original error is re-raised unchanged. Cost: nothing on the success path except one store write per group.
"""

from __future__ import annotations

import json
import os
import socket
import time

import torch.distributed as dist

from hpdl.runtime.errors import CollectiveTimeoutError, PeerFailedError
from hpdl.runtime.procs import pid_alive

_CONNECTION_WORDS = ("connection closed", "connection reset", "broken pipe", "connection refused",
                     "socket closed", "end of file", "read error", "write error")


def is_peer_failure(exc: BaseException) -> bool:
    """True for the transport errors a dead peer causes (gloo's socket errors), not for argument errors."""
    if isinstance(exc, CollectiveTimeoutError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    msg = str(exc).lower()
    return any(w in msg for w in _CONNECTION_WORDS) or "timed out" in msg or "timeout" in msg


def window(timeout: float) -> float:
    """Seconds the post-mortem waits for the other ranks' reports: half the timeout, within [1, 10] s (ranks
    that hit the same stuck peer time out within one clock skew of each other)."""
    return min(max(timeout / 2.0, 1.0), 10.0)


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (MPI launch, torch without it): no post-mortem
        return None


class FailureBoard:
    """Per-group handle on the store: publishes this rank's (host, pid) once and runs post-mortems.

    Args:
        name: a name of the group equal on every rank (its ``group_name``).
        global_ranks: the group's ranks in the default group, indexed by group rank.
        rank: this process's group rank.
    """

    def __init__(self, name: str, global_ranks: list[int], rank: int):
        self.name, self.global_ranks, self.rank = name, list(global_ranks), rank
        self.store = _store()
        self.host = socket.gethostname()
        if self.store is not None:
            try:
                self.store.set(self._key("pid", self.rank), f"{self.host} {os.getpid()}")
            except Exception:  # noqa: BLE001 - a broken store only costs the diagnosis
                self.store = None

    def _key(self, *parts) -> str:
        return "hpdl/fail/" + "/".join(str(p) for p in (self.name,) + parts)

    def _dead(self, r: int) -> bool:
        key = self._key("pid", r)
        try:
            if not self.store.check([key]):
                return False
            host, pid = self.store.get(key).decode().split()
        except Exception:  # noqa: BLE001
            return False
        return host == self.host and not pid_alive(int(pid))

    def diagnose(self, what: str, call: int, timeout: float, cause: BaseException) -> BaseException:
        """The error to raise for ``cause`` (raised by collective number ``call`` on this group): a typed error
        naming the culprit ranks, or ``cause`` itself when the post-mortem cannot tell."""
        if self.store is None or len(self.global_ranks) == 1:
            return cause
        own = list(getattr(cause, "missing_ranks", []) or [])
        try:
            self.store.set(self._key(call, self.rank), json.dumps({"missing": own, "error": str(cause)[:200]}))
        except Exception:  # noqa: BLE001 - the store's host (rank 0) may be the dead one
            return cause
        others = [r for r in range(len(self.global_ranks)) if r != self.rank]
        reported: set[int] = set()
        deadline = time.monotonic() + window(timeout)
        while True:
            try:
                for r in others:
                    if r not in reported and self.store.check([self._key(call, r)]):
                        reported.add(r)
            except Exception:  # noqa: BLE001
                return cause
            silent = [r for r in others if r not in reported]
            dead = [r for r in silent if self._dead(r)]
            if dead:
                return PeerFailedError(
                    f"{what} (call {call} on this group): rank {self.rank} lost rank(s) {dead}, whose process is "
                    f"gone (killed or crashed) before reporting; ranks {sorted(reported)} saw the failure too",
                    missing_ranks=dead)
            if not silent:
                return cause
            if time.monotonic() >= deadline:
                kind = PeerFailedError if not isinstance(cause, CollectiveTimeoutError) else CollectiveTimeoutError
                return kind(
                    f"{what} (call {call} on this group): rank {self.rank} gave up after {timeout:.0f}s; rank(s) "
                    f"{silent} did not answer (stopped, killed on another host, or never called {what}); ranks "
                    f"{sorted(reported)} saw the failure too. First error here: {str(cause)[:300]}",
                    missing_ranks=silent)
            time.sleep(0.02)
