"""The driver-worker messages: typed records with a protocol version, sent over a ``multiprocessing`` pipe
(local workers) or a ``multiprocessing.connection`` socket (Ray tasks), pickled.

Driver -> worker: :class:`RunTask` (one trial), :class:`Preempt` (checkpoint now and stop that trial; the
worker takes the next one), :class:`Stop` (checkpoint a running trial, then exit).

Worker -> driver: :class:`Ready` (start-up done; seconds per phase), :class:`Hello` (a Ray task connected),
:class:`ProfileReport`, :class:`PeakMemory` (a CUDA trial's whole-run peak, sent before its outcome), and one
outcome per trial: :class:`Done`, :class:`Pruned`, :class:`Halted` (stopped at a checkpoint on request),
:class:`Failed` (``kind`` ``oom``, ``error``, ``checkpoint`` or ``checkpoint_write``; the worker exits after it).

Every record carries ``version``; :func:`check` refuses a record of another version (a Ray worker running
another hpdl), so a mismatch is an error naming both versions instead of a misread field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpdl.hpo.errors import HpoError

PROTOCOL_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Message:
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Task:
    """What a worker needs to run one trial. ``params``: the sampled parameters (the worker adds the study's
    fixed ones); ``profile``: measure the first steps (``static``: the meta-device estimate, a
    :class:`hpdl.hpo.profiler.TrialProfile` as a dict); ``memory_cap``: bytes with the context, or None;
    ``context_bytes``: a CUDA context's bytes (0 on CPU); ``study_uid`` and ``checkpoint_dir``: whose
    checkpoints the trial may read and where (:mod:`hpdl.hpo.checkpoint`); ``fused``: a fused group's trials,
    one task each (:mod:`hpdl.hpo.fusion`), this task then standing for the group (its profile, memory cap and
    ``trial_id`` for group-wide messages)."""

    trial_id: int
    number: int
    lineage: int
    params: dict
    device_id: str = ""
    host: str = ""
    study_uid: str = ""
    checkpoint_dir: str = ""
    profile: bool = False
    static: dict | None = None
    context_bytes: int = 0
    memory_cap: int | None = None
    fused: tuple = ()


@dataclass(frozen=True, kw_only=True)
class RunTask(Message):
    task: Task


@dataclass(frozen=True, kw_only=True)
class Preempt(Message):
    trial_id: int


@dataclass(frozen=True, kw_only=True)
class Stop(Message):
    pass


@dataclass(frozen=True, kw_only=True)
class Ready(Message):
    pid: int
    startup: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    token: int
    pid: int


@dataclass(frozen=True, kw_only=True)
class TrialMessage(Message):
    trial_id: int


@dataclass(frozen=True, kw_only=True)
class ProfileReport(TrialMessage):
    profile: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class PeakMemory(TrialMessage):
    kind: str
    bytes: int


@dataclass(frozen=True, kw_only=True)
class Done(TrialMessage):
    value: float


@dataclass(frozen=True, kw_only=True)
class Pruned(TrialMessage):
    pass


@dataclass(frozen=True, kw_only=True)
class Halted(TrialMessage):
    pass


@dataclass(frozen=True, kw_only=True)
class Failed(TrialMessage):
    kind: str
    message: str


def check(msg: Any) -> Message:
    """``msg`` if it is a record of this protocol version.

    Raises:
        HpoError: not a protocol record, or another version (both named).
    """
    if not isinstance(msg, Message):
        raise HpoError(f"hpo protocol: expected a message record, got {type(msg).__name__} {msg!r:.100}")
    if msg.version != PROTOCOL_VERSION:
        raise HpoError(f"hpo protocol: {type(msg).__name__} has version {msg.version}, this driver speaks "
                       f"{PROTOCOL_VERSION} (workers and driver run different hpdl versions)")
    return msg
