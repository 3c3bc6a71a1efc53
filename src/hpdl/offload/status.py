"""What an executor reports of a running request (the Python executor and the native one alike)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pending:
    """An operation of a running request that is not done: its description, peer, and what it waits for."""

    op: str
    peer: int | None
    state: str

    def __str__(self) -> str:
        return f"{self.op} {self.state}"


@dataclass(frozen=True)
class Status:
    """What a request's executor knows: its error (None if none), the remote endpoint blamed for it (a
    transport failure), and the operations still outstanding."""

    error: str | None
    culprit: str | None
    pending: tuple[Pending, ...]
    dead_ranks: tuple[int, ...] = ()  # group ranks whose process died (culprit None then)
