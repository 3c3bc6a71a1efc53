"""Shared runtime: process-group bootstrap, topology, timeouts, errors and ``HPDL_*`` configuration.

The names below are loaded on first use (PEP 562), so ``hpdl.runtime.errors``, ``env`` and ``procs`` stay
importable without torch: the ``hpdl`` command imports them before it knows whether torch is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    "CLIUsageError": "errors", "CollectiveMismatchError": "errors", "CollectiveTimeoutError": "errors",
    "HpdlError": "errors", "PeerFailedError": "errors", "ProtocolError": "errors", "WorkerFailedError": "errors",
    "Context": "launch", "detect_launcher": "launch", "free_port": "launch", "init_from_env": "launch",
    "spawn": "launch", "WorkerGroup": "launch", "Service": "launch", "Topology": "topology", "discover": "topology",
}

__all__ = sorted(_WHERE)

if TYPE_CHECKING:
    from hpdl.runtime.errors import (CLIUsageError, CollectiveMismatchError, CollectiveTimeoutError, HpdlError,
                                     PeerFailedError, ProtocolError, WorkerFailedError)
    from hpdl.runtime.launch import Context, Service, WorkerGroup, detect_launcher, free_port, init_from_env, spawn
    from hpdl.runtime.topology import Topology, discover


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"hpdl.runtime.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpdl.runtime' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
