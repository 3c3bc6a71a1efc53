"""``algorithm="auto"``: message size, world size, device and topology -> algorithm and throttle window.

The default table below comes from the measurements in docs/benchmarks/ (the row comments say which);
``hpdl bench allreduce --tune PATH`` measures every algorithm on the current machine and writes a new
table, which ``HPDL_TUNING_FILE=PATH`` (or :func:`set_table`) makes active.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from hpdl.runtime import env

INF = 1 << 62


@dataclass(frozen=True)
class Rule:
    """Use ``algorithm`` (with ``window``) for messages of at most ``max_bytes`` on ``device``.

    Rules are matched in order; the first whose device, world-size range and byte bound fit wins.
    """

    device: str
    max_bytes: int
    algorithm: str
    window: int | None = None
    min_world: int = 1
    max_world: int = INF


@dataclass
class TuningTable:
    rules: list[Rule]
    source: str = "default"

    def select(self, nbytes: int, world_size: int, device_type: str) -> tuple[str, int | None]:
        """``(algorithm, window)`` for one call; ``("native", None)`` when no rule matches."""
        for rule in self.rules:
            if (rule.device == device_type and rule.min_world <= world_size <= rule.max_world
                    and nbytes <= rule.max_bytes):
                return rule.algorithm, rule.window
        return "native", None

    def to_json(self) -> str:
        return json.dumps({"source": self.source, "rules": [asdict(r) for r in self.rules]}, indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "file") -> "TuningTable":
        data = json.loads(text)
        try:
            rules = [Rule(**r) for r in data["rules"]]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"tuning table {source!r} is malformed: {exc}") from None
        return cls(rules, data.get("source", source))


# CPU (gloo) defaults from docs/benchmarks/cpu.md (4 and 8 processes, 32-core host, 2026-11-29):
# recursive doubling 2-4.6x native up to 32 KiB; direct 1.2-1.8x native from 64 KiB to 512 KiB (4 ranks)
# and 1 MiB (8 ranks); above that gloo's own chunked C++ all-reduce is faster, so auto uses it.
# CUDA, one node: peer-memory kernels (docs/benchmarks/gpu_allreduce.md, 2 x H200: one-shot up to 1 MiB, then
# two-shot; NCCL never faster from 8 B to 1 GiB). Above 2 GPUs the one-shot limits follow vLLM's custom
# all-reduce and are not yet measured here. Calls the kernels cannot take (float64, uint8, more ranks than
# this host's GPUs) fall back to native.
DEFAULT_RULES = [
    Rule("cuda", 1 << 20, "one_shot", max_world=2),
    Rule("cuda", INF, "two_shot", max_world=2),
    Rule("cuda", 512 << 10, "one_shot", min_world=3, max_world=4),
    Rule("cuda", INF, "two_shot", min_world=3, max_world=4),
    Rule("cuda", 256 << 10, "one_shot", min_world=5, max_world=8),
    Rule("cuda", INF, "two_shot", min_world=5, max_world=8),
    Rule("cpu", INF, "native", min_world=1, max_world=1),
    Rule("cpu", 48 << 10, "recursive_doubling"),
    Rule("cpu", 768 << 10, "direct", window=4, max_world=4),
    Rule("cpu", 1536 << 10, "direct", window=4, min_world=5),
    Rule("cpu", INF, "native"),
    Rule("cuda", INF, "native"),
]

_active: TuningTable | None = None


def default_table() -> TuningTable:
    return TuningTable(list(DEFAULT_RULES))


def set_table(table: TuningTable | None) -> None:
    """Make ``table`` the active one (None restores the default / ``HPDL_TUNING_FILE``)."""
    global _active
    _active = table


def active_table() -> TuningTable:
    global _active
    if _active is None:
        path = env.get("HPDL_TUNING_FILE")
        if path:
            try:
                text = Path(path).read_text()
            except OSError as exc:
                raise ValueError(f"HPDL_TUNING_FILE={path!r} cannot be read ({exc.strerror}); write a table with "
                                 "`hpdl bench allreduce --tune FILE` or unset the variable") from None
        _active = TuningTable.from_json(text, source=path) if path else default_table()
    return _active


def select(nbytes: int, world_size: int, device_type: str) -> tuple[str, int | None]:
    return active_table().select(nbytes, world_size, device_type)
