"""Shared runtime: process-group bootstrap, topology, timeouts, errors and ``HPDL_*`` configuration."""

from hpdl.runtime.errors import (CollectiveMismatchError, CollectiveTimeoutError, HpdlError, PeerFailedError,
                                 WorkerFailedError)
from hpdl.runtime.launch import Context, detect_launcher, free_port, init_from_env, spawn
from hpdl.runtime.topology import Topology, discover

__all__ = [
    "CollectiveMismatchError", "CollectiveTimeoutError", "Context", "HpdlError", "PeerFailedError", "Topology", "WorkerFailedError",
    "detect_launcher", "discover", "free_port", "init_from_env", "spawn",
]
