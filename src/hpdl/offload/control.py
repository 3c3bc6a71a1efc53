"""Messages of the control channel between an application rank and its node's agent (a Unix socket).

The data path never uses this channel: ``start()`` writes a mailbox and rings a doorbell; completion comes
back through the mailbox. The channel carries registration (compile), free, key allocation and queries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpdl.offload.compiler import CompiledPlan


@dataclass(frozen=True)
class Hello:
    """First message of a client: who it is and where its mailboxes live."""

    label: str
    pid: int
    mailbox_path: str
    slots: int


@dataclass(frozen=True)
class Welcome:
    agent: int          # index of this agent among all agents (its endpoint number)
    agents: int
    pid: int
    node: str           # hostname
    status_path: str
    bell_path: str
    cores: tuple[int, ...] = ()  # cores the agent's native executor is pinned to (empty: none)


@dataclass(frozen=True)
class NewKey:
    """Ask for a plan key unique among all agents (a counter in the agents' store)."""


@dataclass(frozen=True)
class Register:
    """Register one rank's compiled plan; ``buffers`` maps names to ShmHandles (CPU) or CUDA tensors."""

    slot: int
    plan: CompiledPlan
    buffers: dict[str, Any] = field(default_factory=dict)
    ready_event: tuple[int, bytes] | None = None  # (device, CUDA IPC handle) of the event start() records
    native: bool = True  # the native executor may run it (the group's every plan is eligible: see api._compile)


@dataclass(frozen=True)
class Free:
    slot: int


@dataclass(frozen=True)
class Query:
    """Error text and outstanding operations of the request in ``slot``."""

    slot: int


@dataclass(frozen=True)
class Shutdown:
    """Stop the agent (sent by the rank that started it)."""


@dataclass(frozen=True)
class Reply:
    ok: bool
    value: Any = None
    error: str = ""
