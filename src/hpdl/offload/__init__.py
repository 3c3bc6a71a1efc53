"""hpdl.offload: offload any communication pattern to a progress agent, with full overlap (seed 7).

Describe a pattern once as a :class:`Plan` (named buffers; send, recv, put, get, copy and reduce operations
with explicit dependencies), :func:`compile` it on every rank (validated across ranks) into a
:class:`PersistentRequest`, then ``start()`` / ``test()`` / ``wait()`` it as often as needed, as MPI's
persistent requests. A progress agent per node (:class:`Agent`, ``hpdl offload agent``) runs started plans
on the application's buffers in place while the application computes; without one, an in-process progress
thread does. Ready-made plans are in :mod:`hpdl.offload.plans`. See docs/offload.md.
"""

from hpdl.offload import plans
from hpdl.offload.api import (PersistentRequest, allreduce_init, alltoall_init, compile, simulate, startall,
                              testall, waitall)
from hpdl.offload.client import Agent, AgentClient, connect
from hpdl.offload.compiler import CompiledPlan, check_plan, compile_group
from hpdl.offload.errors import AgentError, OffloadError, OffloadPeerError, OffloadTimeoutError, PlanError
from hpdl.offload.plan import BufferRef, OpRef, Plan, PlanData, Region
from hpdl.offload.shm import empty, zeros

__all__ = [
    "Agent", "AgentClient", "AgentError", "BufferRef", "CompiledPlan", "OffloadError", "OffloadPeerError", "OffloadTimeoutError",
    "OpRef", "PersistentRequest", "Plan", "PlanData", "PlanError", "Region", "allreduce_init", "alltoall_init",
    "check_plan", "compile", "compile_group", "connect", "empty", "plans", "simulate", "startall", "testall",
    "waitall", "zeros",
]
