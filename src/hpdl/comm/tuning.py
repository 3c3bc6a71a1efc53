"""``algorithm="auto"``: the one selection table of every collective.

``select(collective, nbytes, world_size, device_type, topology=None) -> (algorithm, window)`` answers for
``all_reduce``, ``reduce_scatter``, ``all_gather`` and ``all_to_all`` (all_to_all_single), including the
peer-memory kernels and the two-level all-to-all variants. The default table below comes from the measurements
in docs/benchmarks/ (the row comments say which); ``hpdl bench allreduce --tune PATH`` measures every algorithm
on the current machine and writes a new table in the same JSON format (rules of every collective), which
``HPDL_TUNING_FILE=PATH`` (or :func:`set_table`) makes active. Files written before the ``collective`` field
existed load as all_reduce rules.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from hpdl.runtime import env

INF = 1 << 62
# broadcast, reduce and barrier have no default rules yet: auto runs native until a measured table says otherwise
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce", "barrier")
_COLLECTIVE_ALIASES = {"allreduce": "all_reduce", "reducescatter": "reduce_scatter", "allgather": "all_gather",
                       "alltoall": "all_to_all", "all_to_all_single": "all_to_all",
                       "reduce_scatter_tensor": "reduce_scatter", "all_gather_into_tensor": "all_gather"}
# algorithms that run only among the GPUs of one host (peer memory): skipped for a topology of several nodes
ONE_NODE = {"all_reduce": ("one_shot", "two_shot"), "all_to_all": ("push", "pull")}


def canonical_collective(name: str) -> str:
    """``name`` as one of :data:`COLLECTIVES` (bench's "allreduce"/"alltoall" spellings accepted).

    Raises:
        ValueError: unknown collective, naming the valid ones.
    """
    key = _COLLECTIVE_ALIASES.get(name, name)
    if key not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES} (or {sorted(_COLLECTIVE_ALIASES)}), got {name!r}")
    return key


@dataclass(frozen=True)
class Rule:
    """Use ``algorithm`` (with ``window``) for ``collective`` messages of at most ``max_bytes`` (per rank) on
    ``device``.

    Rules are matched in order; the first whose collective, device, world-size range and byte bound fit wins.
    :meth:`TuningTable.validated` (run on every table loaded or set) checks the fields.
    """

    device: str
    max_bytes: int
    algorithm: str
    window: int | None = None
    min_world: int = 1
    max_world: int = INF
    collective: str = "all_reduce"


@dataclass
class TuningTable:
    rules: list[Rule]
    source: str = "default"

    def select(self, collective, nbytes: int, world_size: int, device_type: str | None = None,
               topology=None) -> tuple[str, int | None]:
        """``(algorithm, window)`` for one call; ``("native", None)`` when no rule matches.

        reduce_scatter / all_gather without rules of their own follow the all_reduce rules, mapped to a
        schedule that has the two phases (direct where the chosen one has none). The old form
        ``select(nbytes, world_size, device_type)`` means all_reduce.
        """
        if not isinstance(collective, str):   # select(nbytes, world_size, device_type)
            collective, nbytes, world_size, device_type = "all_reduce", collective, nbytes, world_size
        coll = canonical_collective(collective)
        if coll == "all_to_all" and world_size == 1:
            return "native", None
        multi_node = topology is not None and not getattr(topology, "single_node", True)
        own = [r for r in self.rules if r.collective == coll]
        phase = coll in ("reduce_scatter", "all_gather") and not own
        if not own and not phase:  # a table without rules for this collective (an all_reduce-only file)
            own = [r for r in DEFAULT_RULES if r.collective == coll]
        for rule in (own if not phase else [r for r in self.rules if r.collective == "all_reduce"]):
            if multi_node and rule.algorithm in ONE_NODE.get(rule.collective, ()):
                continue
            if (rule.device == device_type and rule.min_world <= world_size <= rule.max_world
                    and nbytes <= rule.max_bytes):
                if phase:
                    from hpdl.comm.algorithms.base import implements

                    return (rule.algorithm if implements(rule.algorithm, coll) else "direct"), rule.window
                return rule.algorithm, rule.window
        return "native", None

    def to_json(self) -> str:
        return json.dumps({"source": self.source, "rules": [asdict(r) for r in self.rules]}, indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "file") -> "TuningTable":
        """Parse and validate a table (:meth:`validated`); ``source`` names it in errors.

        Raises:
            ValueError: not JSON, not ``{"rules": [...]}``, or a rule that :meth:`validated` rejects.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tuning table {source!r} is not valid JSON: {exc}") from None
        try:
            rules = [Rule(**r) for r in data["rules"]]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"tuning table {source!r} is malformed: {exc}") from None
        return cls(rules, data.get("source", source) if isinstance(data, dict) else source).validated(source)

    def validated(self, source: str | None = None) -> "TuningTable":
        """This table with every rule checked, aliases spelled canonically (``"allreduce"``, ``"rd"``).

        A rule must name a device ("cpu" / "cuda"), a collective of :data:`COLLECTIVES`, an algorithm of the
        registry that implements that collective (not "auto"), integer byte and world bounds and a window that
        is None or an int >= 1; otherwise every call of ``algorithm="auto"`` would fail later, or silently
        ignore the rule.

        Raises:
            ValueError: naming the table, the rule's index and the field.
        """
        from hpdl.comm.algorithms.base import algorithms_for, canonical, implements

        where = source or self.source
        rules = []
        for i, rule in enumerate(self.rules):
            def bad(msg: str) -> ValueError:
                return ValueError(f"tuning table {where!r}, rule {i} ({asdict(rule)}): {msg}")
            if rule.device not in ("cpu", "cuda"):
                raise bad(f"device must be 'cpu' or 'cuda', got {rule.device!r}")
            try:
                coll = canonical_collective(rule.collective)
                name = canonical(rule.algorithm)
            except (ValueError, TypeError) as exc:
                raise bad(str(exc)) from None
            if name == "auto" or not implements(name, coll):
                raise bad(f"algorithm {rule.algorithm!r} does not implement {coll}; use one of "
                          f"{algorithms_for(coll)}")
            for field in ("max_bytes", "min_world", "max_world"):
                value = getattr(rule, field)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise bad(f"{field} must be a non-negative int, got {value!r}")
            if rule.window is not None and (isinstance(rule.window, bool) or not isinstance(rule.window, int)
                                            or rule.window < 1):
                raise bad(f"window must be null or an int >= 1, got {rule.window!r}")
            rules.append(Rule(rule.device, rule.max_bytes, name, rule.window, rule.min_world, rule.max_world, coll))
        return TuningTable(rules, self.source)


# CPU (gloo) defaults. Up to 48 KiB gloo's own all-reduce: in the applications (docs/benchmarks/apps.md, 16-core
# host, 8 ranks, 2026-12-02) CG's 8-byte all-reduces with recursive doubling made an iteration 1.27-1.68x
# native's (issue 41), and on a loaded 2-core host recursive doubling is 10x slower than gloo at 8 bytes: a
# schedule posted from Python loses to gloo's C++ one at every latency-bound size. (The isolated 32-core sweep
# of 2026-11-29, docs/benchmarks/comm.md history, had recursive doubling 2-4.6x faster; its hpdl calls and
# the apps' also paid an NVML query per call, since removed.) Direct 1.2-1.8x native from 64 KiB to 512 KiB
# (4 ranks) and 1 MiB (8 ranks) on that 32-core host; above that gloo's own chunked C++ all-reduce is faster,
# so auto uses it. benchmarks/comm_apps_device.py measures every CPU rule on the 16-core host against native.
# 8 ranks, its table (2026-12-04 17:29 UTC, docs/benchmarks/data/apps/2026-12-04_1729_comm_apps, 5 interleaved
# rounds; a schedule only where it beat native by >= 5% at the median and in every round): native at 8 B
# (recursive doubling 1.09x), recursive doubling from 64 B to 32 KiB (0.18-0.25x native, the old rule left
# native there), direct to 1 MiB (0.71-0.77x), native at 4 MiB (direct 3.4x). Other world sizes keep the rules
# below until they are measured on that host.
# CUDA, one node: peer-memory kernels (docs/benchmarks/comm.md, 2 x H200: one-shot up to 1 MiB, then
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
    Rule("cpu", 8, "native", min_world=8, max_world=8),
    Rule("cpu", 32 << 10, "recursive_doubling", min_world=8, max_world=8),
    Rule("cpu", 1 << 20, "direct", min_world=8, max_world=8),
    Rule("cpu", INF, "native", min_world=8, max_world=8),
    Rule("cpu", 48 << 10, "native"),
    Rule("cpu", 768 << 10, "direct", window=4, max_world=4),
    Rule("cpu", 1536 << 10, "direct", window=4, min_world=5),
    Rule("cpu", INF, "native"),
    Rule("cuda", INF, "native"),
    # all_to_all_single, bytes per rank. CPU: native gloo was the fastest at every size from 1 KiB to 16 MiB
    # on 8 ranks (docs/benchmarks/comm.md). CUDA on one node: the peer-memory push kernel beat NCCL at
    # every size from 1 KiB to 1 GiB on 2 x H200 (1.05-3.8x eager, docs/benchmarks/comm.md); only 2
    # GPUs are measured, so larger groups keep NCCL until 4/8-GPU runs rewrite this table (--tune).
    Rule("cpu", INF, "native", collective="all_to_all"),
    Rule("cuda", INF, "push", max_world=2, collective="all_to_all"),
    Rule("cuda", INF, "native", collective="all_to_all"),
]

_active: TuningTable | None = None


def default_table() -> TuningTable:
    return TuningTable(list(DEFAULT_RULES))


def set_table(table: TuningTable | None) -> None:
    """Make ``table`` the active one (None restores the default / ``HPDL_TUNING_FILE``)."""
    global _active
    _active = table.validated() if table is not None else None


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


def select(collective, nbytes: int, world_size: int, device_type: str | None = None,
           topology=None) -> tuple[str, int | None]:
    """``(algorithm, window)`` that ``algorithm="auto"`` runs for ``collective`` ("all_reduce",
    "reduce_scatter", "all_gather", "all_to_all") of ``nbytes`` bytes per rank on ``world_size`` ranks of
    ``device_type`` ("cpu" / "cuda"), from the active table. ``topology`` (a :class:`hpdl.runtime.Topology`)
    of several nodes excludes the one-node peer-memory algorithms. At call time the API also falls back to
    native where a peer kernel cannot take the tensor (dtype, fewer visible GPUs than ranks).

    Raises:
        ValueError: unknown collective.
    """
    return active_table().select(collective, nbytes, world_size, device_type, topology)


def resolve(collective, nbytes: int, world_size: int, device_type: str | None = None, topology=None, *,
            dtype=None, gpus: int | None = None) -> tuple[str, int | None]:
    """What ``algorithm="auto"`` runs: :func:`select`, then native where the pick does not fit the call.

    The facts given are checked against the picked algorithm's ``fits`` (the peer kernels need CUDA, a kernel
    dtype, one node and a GPU of this host per rank): ``dtype`` (a torch dtype), ``gpus`` (this host's visible
    GPUs), ``topology``. The API passes all it knows; ``hpdl bench`` passes the dtype and GPU count of a sweep
    before launching it. Returns ``(algorithm, window)``.

    Raises:
        ValueError: unknown collective.
    """
    name, window = select(collective, nbytes, world_size, device_type, topology)
    from hpdl.comm.algorithms.base import get_class

    if not get_class(name).fits(device_type or "cpu", world_size, dtype=dtype, gpus=gpus, topology=topology):
        return "native", None
    return name, window
