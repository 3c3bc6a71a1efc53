"""The collective benchmark's tables (nccl-tests / OSU columns), markdown and tuning tables from its rows (JSON,
plots and the rest are the harness's, :mod:`hpdl.bench.common`).

Columns: size (B) and count of the largest buffer; algbw = size / time; busbw = algbw x the collective's
factor (all-reduce 2(p-1)/p, reduce-scatter and all-gather (p-1)/p: NVIDIA/nccl-tests doc/PERFORMANCE.md), so
busbw compares with link bandwidth whatever the rank count. ``#wrong`` counts elements that differ from the
exact result, summed over ranks; ``vs native`` is native's time over this row's, measured in the same run.
"""

from __future__ import annotations

from itertools import groupby
from typing import Sequence

from hpdl.bench.common import Column, source_commit  # noqa: F401 (source_commit: its old home; common owns it)
from hpdl.bench.harness import NOISE, REPEATS, Row, algo_label, speedup_text
from hpdl.comm.tuning import INF, Rule, TuningTable, default_table

# nccl-tests' header, then the speed-up over native, its direction in the header as in every harness table
VS_NATIVE = Column("speedup", "vs native", ratio="speed-up")
_COLUMNS = ("size(B)", "count", "type", "redop", "algorithm", "avg(us)", "min(us)", "max(us)", "algbw(GB/s)",
            "busbw(GB/s)", "#wrong", VS_NATIVE.label)


def format_table(rows: Sequence[Row], title: str = "") -> str:
    """nccl-tests' columns, one row per (size, algorithm); columns as wide as their longest cell (algorithm
    names are never cut). ``vs native`` is a min-max range where the repeats spread too much to trust one
    number, with a note under the table saying so."""
    cells = [[str(r.size), str(r.count), r.dtype, r.op, algo_label(r), f"{r.avg_us:.1f}", f"{r.min_us:.1f}",
              f"{r.max_us:.1f}", f"{r.algbw:.3f}", f"{r.busbw:.3f}", str(r.wrong), speedup_text(r)] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(_COLUMNS)]
    widths[0] = max(widths[0], len(_COLUMNS[0]) + 2, 12)  # room for the header's leading "#"
    lines = [f"# {title}"] if title else []
    lines.append("#" + " ".join(c.rjust(w) for c, w in zip(_COLUMNS, widths))[1:])
    lines += [" ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    if any(r.speedup is not None for r in rows):
        lines.append("# vs native: speed-up (native's time / this row's), higher is better")
    if any(r.noisy for r in rows):
        lines.append(f"# vs native as lo-hi: the {REPEATS} timed repeats of that row or of native spread by more "
                     f"than {NOISE:.0%}, so the speed-up lies anywhere in that range on this machine (a loaded host; "
                     "rerun with a longer --time-per-point, or on an idle one)")
    if any(r.mode == "graph" for r in rows):
        lines.append("# times are CUDA-graph replays (launch overhead excluded), per call")
    lines.append(f"# Out of bounds values : {sum(r.wrong for r in rows)} {'OK' if not any(r.wrong for r in rows) else 'FAILED'}")
    return "\n".join(lines)


class NoisySweepError(ValueError):
    """A sweep too noisy to choose algorithms from (``rows``: the noisy rows); the message says how to rerun."""

    def __init__(self, message: str, rows: Sequence[Row]):
        super().__init__(message)
        self.rows = list(rows)

    def __reduce__(self):   # pickled across processes: Exception's default passes only the message back
        return type(self), (str(self), self.rows), self.__dict__


def tuned_table(rows: Sequence[Row], world_size: int, device: str, noise: float = 0.05) -> TuningTable:
    """Fastest correct algorithm per size, merged into byte ranges, for ``world_size`` on ``device``.

    A non-native algorithm is chosen only when it beats native by more than ``noise`` (so that ``auto``
    never loses to the baseline within measurement noise). Rows for other worlds/devices keep the defaults.

    Raises:
        NoisySweepError: a row is :attr:`Row.noisy` (its repeats, or native's, spread by more than
            :data:`NOISE`, the condition under which :func:`format_table`'s footer prints its speed-up as a range):
            a choice from such numbers is a coin toss, so no table is made from them.
    """
    noisy = [r for r in rows if r.noisy]
    if noisy:
        sizes = sorted({r.size for r in noisy})
        raise NoisySweepError(
            f"{len(noisy)} of {len(rows)} rows are noisy (their {REPEATS} repeats, or native's, spread by more than "
            f"{NOISE:.0%}) at sizes {', '.join(map(str, sizes))} B: a table chosen from them would be noise. Rerun "
            "with a longer --time-per-point (or only those sizes, -b/-e), on an idle host", noisy)
    best: list[tuple[int, str, int | None]] = []
    for size, group in groupby(sorted(rows, key=lambda r: r.size), key=lambda r: r.size):
        cands = [r for r in group if r.wrong == 0 and r.algorithm != "auto"]
        if not cands:
            continue
        native = next((r for r in cands if r.algorithm == "native"), None)
        win = min(cands, key=lambda r: r.avg_us)
        if native is not None and win.avg_us > native.avg_us * (1 - noise):
            win = native
        best.append((size, win.resolved, win.window))
    rules: list[Rule] = []
    for i, (size, algo, window) in enumerate(best):
        last = i == len(best) - 1
        nxt = best[i + 1] if not last else None
        if nxt is not None and (nxt[1], nxt[2]) == (algo, window):
            continue
        # the boundary sits between this measured size and the next one
        bound = INF if last else (size + nxt[0]) // 2
        rules.append(Rule(device, bound, algo, window, min_world=world_size, max_world=world_size))
    return TuningTable(rules + default_table().rules, source=f"hpdl bench --tune (world {world_size}, {device})")


def markdown(rows: Sequence[Row], meta: dict) -> str:
    """One table per run: latency (us) of each algorithm per size, with its speed-up over native."""
    algos = list(dict.fromkeys(r.algorithm for r in rows))
    head = "| size (B) | " + " | ".join(f"{a} (us)" for a in algos) + " | #wrong |"
    lines = [f"{meta.get('collective', '')} {meta.get('dtype', '')} {meta.get('op', '')}, "
             f"{meta.get('world_size')} ranks, device {meta.get('device')}, torch {meta.get('torch')}, "
             f"{meta.get('date')}", "", f"Command: `{meta.get('command', '')}`", "", head,
             "|" + "---|" * (len(algos) + 2)]
    for size, group in groupby(sorted(rows, key=lambda r: r.size), key=lambda r: r.size):
        by = {r.algorithm: r for r in group}
        cells = []
        for a in algos:
            r = by.get(a)
            if r is None:
                cells.append("-")
                continue
            label = f" ({r.resolved})" if a == "auto" else ""
            cells.append(f"{r.avg_us:.1f}{label}" + (f" {speedup_text(r)}" if a != "native" and r.speedup else ""))
        lines.append(f"| {size} | " + " | ".join(cells) + f" | {sum(r.wrong for r in by.values())} |")
    return "\n".join(lines)
