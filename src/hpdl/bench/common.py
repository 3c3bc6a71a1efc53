"""The experiment harness every ``hpdl`` benchmark runs on (nccl-tests' ``common.cu``; a benchmark is a plug-in).

A plug-in is a :class:`Benchmark` subclass. It gives

- its arguments (:meth:`Benchmark.add_arguments`) and their checks (:meth:`Benchmark.validate`),
- ``run(ctx) -> rows`` (dicts or dataclasses; ``None`` on ranks that do not report),
- its :attr:`Benchmark.columns` (:class:`Column`: units on every measured column, and every ratio column says
  which way is better) and a :attr:`Benchmark.plot_spec` (:class:`PlotSpec`),

and the harness owns the rest, the same for every benchmark: run metadata (:func:`run_metadata`: one UTC
clock, host, versions, commit, command), the output flags (:func:`add_output_arguments`: ``--format
table|json``, ``--json FILE``, ``--out DIR``, ``--plot PNG``, checked before the run by :func:`check_outputs`),
progress on stderr (:class:`Progress`: a rich bar on a terminal, a flushed line per step otherwise), tables
(:func:`format_table`, rich), plots (:func:`pyplot` selects matplotlib's Agg backend once; :func:`plot_rows`)
and the exit status (1 when :meth:`Benchmark.failed`, e.g. a non-zero ``#wrong``; 2 for a usage error found
before the run, as argparse's).

:func:`command` turns a plug-in into the ``add_arguments(parser)`` / ``run(args) -> int`` class that ``hpdl``'s
command registries load by ``"module:Class"`` path. This module imports nothing of hpdl's subsystems.
"""

from __future__ import annotations

import argparse
import dataclasses
from abc import ABC, abstractmethod
import io
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from hpdl.runtime.errors import CLIUsageError

__all__ = ["EXIT_USAGE", "Benchmark", "Column", "Panel", "PlotSpec", "Progress", "RunContext",
           "add_output_arguments", "as_row", "check_outputs", "command", "format_table", "invocation", "main",
           "plot_rows", "pyplot", "ratio_direction", "run_metadata", "source_commit", "usage_checks", "utc_now"]


# ----------------------------------------------------------------------------------------------- metadata

def utc_now() -> str:
    """The one clock of every result file: ``"2026-12-04 19:05 UTC"``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def source_commit() -> str:
    """The commit benchmark results record: ``HPDL_COMMIT`` when set, else the checkout's ``HEAD`` (with
    ``+dirty`` when tracked files differ), else ``"unknown"`` (no git, or not a checkout)."""
    from hpdl.runtime import env

    if env.get("HPDL_COMMIT"):
        return env.get("HPDL_COMMIT")
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def command_line() -> str:
    """How this process was started, as a user would retype it: ``hpdl bench ...`` for the ``hpdl`` command
    (also ``python -m hpdl.cli``), ``python3 SCRIPT ...`` for a script."""
    argv0 = sys.argv[0] if sys.argv else ""
    name = Path(argv0).name
    if name in ("hpdl", "cli.py", "__main__.py", "-m", "-c", ""):
        return " ".join(["hpdl", *sys.argv[1:]])
    return " ".join(["python3", argv0, *sys.argv[1:]])


def invocation(meta: dict, default: str) -> str:
    """The ``hpdl`` sub-command of ``meta["command"]`` as typed, its words before the first option (``hpdl moe
    bench`` for ``hpdl moe bench --world-size 2``; ``hpdl``'s own ``--debug`` skipped); ``default`` when the
    command is not ``hpdl``'s (a script)."""
    words = [w for w in str(meta.get("command", "")).split() if w != "--debug"]
    if not words or words[0] != "hpdl":
        return default
    head = []
    for w in words[:3]:   # hpdl GROUP COMMAND at most: a positional argument after them is no part of the name
        if w.startswith("-"):
            break
        head.append(w)
    return " ".join(head) if len(head) > 1 else default


def run_metadata(device: str | None = None, command: str | None = None, versions: Iterable[str] = (),
                 **extra: Any) -> dict:
    """What every result file records about its run: ``date`` (UTC), ``host``, ``cpu``, ``cores``, ``python``,
    ``torch``, ``commit``, ``command``; with ``device="cuda"`` (or ``"cuda:N"``) and a visible GPU also ``gpu``,
    ``cuda`` and ``nccl``; ``versions`` names further packages whose ``__version__`` to record when importable
    (e.g. ``("timm",)``). ``extra`` is merged last (the benchmark's own settings)."""
    import torch

    meta: dict[str, Any] = {"date": utc_now(), "host": platform.node(),
                            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                            "python": platform.python_version(), "torch": torch.__version__,
                            "commit": source_commit(), "command": command or command_line()}
    if device is not None:
        meta["device"] = str(device)
        if str(device).startswith("cuda") and torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name(0)
            meta["cuda"] = torch.version.cuda
            try:
                meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            except (AttributeError, RuntimeError):  # a build without NCCL
                pass
    for name in versions:
        try:
            meta[name] = __import__(name).__version__
        except ImportError:
            pass
    meta.update(extra)
    return meta


# -------------------------------------------------------------------------------------------------- tables

# what a ratio column's number means, written under every table that has one
RATIOS = {"speed-up": "speed-up (the reference's time / this row's): higher is better",
          "time ratio": "time ratio (this row's time / the reference's): lower is better"}


def ratio_direction(ratio: str) -> str:
    """``"speed-up, higher is better"`` or ``"time ratio, lower is better"``: what a ratio column's header says.

    Raises:
        ValueError: ``ratio`` is not a key of :data:`RATIOS`.
    """
    if ratio not in RATIOS:
        raise ValueError(f"ratio must be one of {sorted(RATIOS)}, got {ratio!r}")
    return f"{ratio}, {'higher' if ratio == 'speed-up' else 'lower'} is better"


@dataclass(frozen=True)
class Column:
    """One column of a result table.

    ``key`` is a row's field (or a function of the row); ``unit`` is printed in the header (``"us"`` gives
    ``avg (us)``); ``fmt`` is a format spec (``".1f"``) or a function returning the cell's text; a missing or
    None value prints ``-``. ``ratio`` marks a ratio column: ``"speed-up"`` (higher is better) or ``"time
    ratio"`` (lower is better); its header says so (:attr:`label`: ``vs native (speed-up, higher is better)``),
    its cells end in ``x`` and a note under the table says what the ratio divides.
    """

    key: str | Callable[[dict], Any]
    header: str
    unit: str = ""
    fmt: str | Callable[[Any], str] = ""
    ratio: str | None = None

    def __post_init__(self):
        if self.ratio is not None and self.ratio not in RATIOS:
            raise ValueError(f"ratio must be one of {sorted(RATIOS)} or None, got {self.ratio!r}")

    @property
    def label(self) -> str:
        """The header as printed: ``avg (us)``; a ratio column always with its kind and direction, ``vs native
        (speed-up, higher is better)`` or ``vs blocking (time ratio, lower is better)`` (made here, so that no
        table can leave the direction out)."""
        if self.ratio:
            return f"{self.header} ({ratio_direction(self.ratio)})"
        return f"{self.header} ({self.unit})" if self.unit else self.header

    def cell(self, row: dict) -> str:
        value = self.key(row) if callable(self.key) else row.get(self.key)
        if value is None:
            return "-"
        if callable(self.fmt):
            return self.fmt(value)
        text = format(value, self.fmt) if self.fmt else str(value)
        return text + "x" if self.ratio and isinstance(value, (int, float)) else text


def as_row(row: Any) -> dict:
    """A result row as a dict (dataclass rows through their ``as_dict`` or :func:`dataclasses.asdict`)."""
    if isinstance(row, dict):
        return row
    if hasattr(row, "as_dict"):
        return row.as_dict()
    if dataclasses.is_dataclass(row):
        return dataclasses.asdict(row)
    raise TypeError(f"a result row must be a dict or a dataclass, got {type(row).__name__}")


def _rule_box():
    from rich import box

    # rich's SIMPLE_HEAD in ASCII: one rule of dashes under the header, nothing else (logs stay 7-bit)
    return box.Box("    \n    \n -- \n    \n    \n    \n    \n    \n", ascii=True)


def format_table(rows: Sequence[Any], columns: Sequence[Column], title: str = "") -> str:
    """``rows`` as a plain-text table (rich, no colour, columns as wide as their longest cell, nothing cut),
    ``# title`` above it and, for each ratio column, a ``# header: speed-up ... higher is better`` note under it."""
    from rich.console import Console
    from rich.table import Table

    table = Table(box=_rule_box(), show_edge=False, pad_edge=False, header_style="", expand=False)
    for c in columns:
        table.add_column(c.label, justify="right", no_wrap=True)
    for r in rows:
        d = as_row(r)
        table.add_row(*(c.cell(d) for c in columns))
    buf = io.StringIO()
    Console(file=buf, width=10_000, color_system=None, force_terminal=False, highlight=False,
            emoji=False, markup=False).print(table)
    body = [line.rstrip() for line in buf.getvalue().splitlines() if line.strip()]
    notes = [f"# {c.header}: {RATIOS[c.ratio]}" for c in columns if c.ratio]
    return "\n".join(([f"# {title}"] if title else []) + body + notes)


# --------------------------------------------------------------------------------------------------- plots

def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display: benchmarks run headless), selected
    here once for every hpdl figure."""
    global _AGG
    if not _AGG:
        import matplotlib

        matplotlib.use("Agg")
        _AGG = True
    import matplotlib.pyplot as plt

    return plt


_AGG = False  # set once pyplot() has selected the backend


@dataclass(frozen=True)
class Panel:
    """One axes of a :class:`PlotSpec`: ``y`` (a row field or a function of the row) against the spec's x,
    with its label (name and unit) and scale (``"linear"``, ``"log"`` or ``"log2"``)."""

    y: str | Callable[[dict], float]
    label: str
    yscale: str = "linear"


@dataclass(frozen=True)
class PlotSpec:
    """Lines of ``panels`` against ``x``, one line per value of ``series``; with ``facet``, one column of panels
    per value of that field. ``keep`` drops rows (e.g. failed points) before plotting."""

    x: str
    xlabel: str
    panels: tuple[Panel, ...]
    series: str | Callable[[dict], str]
    xscale: str = "linear"
    facet: str | None = None
    keep: Callable[[dict], bool] | None = None


def _value(key, row):
    return key(row) if callable(key) else row.get(key)


def _scale(ax, axis: str, scale: str) -> None:
    setter = ax.set_xscale if axis == "x" else ax.set_yscale
    if scale == "log2":
        setter("log", base=2)
    elif scale != "linear":
        setter(scale)


def plot_rows(rows: Sequence[Any], spec: PlotSpec, path: str | Path, title: str = "") -> str:
    """Draw ``rows`` as ``spec`` says into the PNG ``path``; returns ``path`` as a string."""
    plt = pyplot()
    data = [as_row(r) for r in rows]
    data = [d for d in data if spec.keep is None or spec.keep(d)]
    facets = sorted({d[spec.facet] for d in data}) if spec.facet else [None]
    side = len(spec.panels) == 2 and len(facets) == 1   # two panels read better side by side than stacked
    if side:
        fig, grid = plt.subplots(1, 2, squeeze=False, figsize=(12, 4.5))
    else:
        fig, grid = plt.subplots(len(spec.panels), len(facets), squeeze=False,
                                 figsize=(4.5 * len(facets) + (1.5 if len(facets) == 1 else 0), 3.4 * len(spec.panels)))
    for c, facet in enumerate(facets):
        part = [d for d in data if facet is None or d[spec.facet] == facet]
        for p, panel in enumerate(spec.panels):
            ax = grid[0][p] if side else grid[p][c]
            for name in dict.fromkeys(str(_value(spec.series, d)) for d in part):
                pts = sorted((d for d in part if str(_value(spec.series, d)) == name), key=lambda d: d[spec.x])
                pts = [d for d in pts if _value(panel.y, d) is not None]
                if pts:
                    ax.plot([d[spec.x] for d in pts], [_value(panel.y, d) for d in pts], marker="o", ms=3,
                            label=name)
            _scale(ax, "x", spec.xscale)
            _scale(ax, "y", panel.yscale)
            ax.set_xlabel(spec.xlabel)
            ax.set_ylabel(panel.label)
            ax.grid(True, which="both", alpha=0.3)
            if facet is not None and p == 0:
                ax.set_title(f"{spec.facet} = {facet}")
            if ax.get_legend_handles_labels()[0] and (c == 0 and p == 0):
                ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


# ------------------------------------------------------------------------------------------------ progress

class Progress:
    """Progress of ``total`` steps on ``stream`` (stderr): a rich bar on a terminal, else one flushed plain line
    per step (``[3/24] allreduce 32 B: ...``), so that a redirected run shows it is alive; ``mode="off"`` (or
    ``enabled=False``, e.g. ranks other than 0) prints nothing. ``header`` is printed first in line mode;
    ``lines`` caps the plain lines of a long run (about that many, and the last step)."""

    def __init__(self, total: int, description: str = "", *, enabled: bool = True, mode: str = "auto",
                 stream=None, header: str | None = None, lines: int | None = None):
        if mode not in ("auto", "bar", "lines", "off"):
            raise ValueError(f"mode must be 'auto', 'bar', 'lines' or 'off', got {mode!r}")
        self._stream = stream if stream is not None else sys.stderr
        if not enabled:
            mode = "off"
        if mode == "auto":
            mode = "bar" if self._stream.isatty() else "lines"
        self.mode, self.total, self.done, self._t0 = mode, total, 0, time.perf_counter()
        self._lines = lines
        self._every = max(1, total // lines) if lines else 1   # line mode: about `lines` lines, and the last
        self._bar = None
        if mode == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, Progress as _Rich, TextColumn, TimeElapsedColumn

            self._bar = _Rich(TextColumn("{task.description:<40}"), BarColumn(), TextColumn("{task.completed}/"
                              "{task.total}"), TimeElapsedColumn(), console=Console(file=self._stream),
                              transient=True)
            self._bar.start()
            self._task = self._bar.add_task(description, total=total)
        elif mode == "lines" and header:
            print(header, file=self._stream, flush=True)

    @property
    def elapsed(self) -> float:
        """Seconds since this progress started."""
        return time.perf_counter() - self._t0

    def advance(self, text: str, steps: int = 1) -> None:
        """``steps`` more steps done; ``text`` says which (the bar's description, or the line after ``[i/n]``)."""
        self.update(self.done + steps, text)

    def update(self, done: int, text: str = "") -> None:
        """``done`` steps done in all (see :meth:`advance`); with ``lines``, a line only every total/lines steps."""
        self.done = done
        if self._bar is not None:
            self._bar.update(self._task, completed=done, description=text)
        elif self.mode == "lines" and (done % self._every == 0 or done == self.total):
            print(f"[{self.done}/{self.total}] {text}", file=self._stream, flush=True)

    def resize(self, total: int) -> None:
        """The run now has ``total`` steps (a re-planned schedule)."""
        self.total = total
        self._every = max(1, total // self._lines) if self._lines else 1
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def note(self, text: str) -> None:
        """A line that is not a step (a phase starting), printed above the bar or as ``# text``."""
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        elif self.mode == "lines":
            print(f"# {text}", file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- arguments

OUTPUTS = ("format", "json", "out", "plot")


def add_output_arguments(parser: argparse.ArgumentParser, outputs: Iterable[str] = OUTPUTS, *,
                         stem: str = "results", out_help: str | None = None, out_metavar: str = "DIR") -> None:
    """Declare the output flags, spelled and meant alike in every benchmark: ``--format table|json`` (stdout),
    ``--json FILE`` (rows and metadata), ``--out DIR`` (a folder for ``STEM.json`` and the figures),
    ``--plot PNG``. ``outputs`` picks which; the values land in ``format``, ``json_path``, ``out_dir``,
    ``plot_path`` (the harness reads an undeclared one as None). ``out_help`` / ``out_metavar`` describe an
    ``--out`` that takes more than a folder (:attr:`Benchmark.out_help`)."""
    outputs = tuple(outputs)
    bad = [o for o in outputs if o not in OUTPUTS]
    if bad:
        raise ValueError(f"outputs must be some of {OUTPUTS}, got {bad}")
    if "format" in outputs:
        parser.add_argument("--format", choices=["table", "json"], default="table",
                            # %(default)s: a defaults-showing formatter then does not add it a second time
                            help="what stdout shows: a table, or JSON (default: %(default)s)")
    if "json" in outputs:
        parser.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                            help="write rows and metadata as JSON to FILE")
    if "out" in outputs:
        parser.add_argument("--out", dest="out_dir", default=None, metavar=out_metavar,
                            help=out_help or f"folder for {stem}.json and the figures (made if missing)")
    if "plot" in outputs:
        parser.add_argument("--plot", dest="plot_path", default=None, metavar="PNG", help="write the plot (PNG)")


def check_outputs(args, files: Iterable[tuple[str, str | None]] = ()) -> None:
    """Make the folders of the output paths before the run, so that a path in a missing folder does not end a
    run of minutes in a FileNotFoundError after it ran. ``files`` adds ``(flag, path)`` pairs of other file
    outputs (e.g. ``("--tune", path)``).

    Raises:
        CLIUsageError: a file path is a folder, ``--out`` is a file, or a folder cannot be made or written,
            naming the flag.
    """
    pairs = [("--json", getattr(args, "json_path", None)), ("--plot", getattr(args, "plot_path", None)), *files]
    for flag, path in pairs:
        if not path:
            continue
        p = Path(path)
        if p.is_dir():
            raise CLIUsageError(f"{flag} {path}: is a folder, expected a file path")
        _writable_folder(flag, path, p.parent)
    out = getattr(args, "out_dir", None)
    if out:
        if Path(out).exists() and not Path(out).is_dir():
            raise CLIUsageError(f"--out {out}: is a file, expected a folder")
        _writable_folder("--out", out, Path(out))


def _writable_folder(flag: str, path: str, folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CLIUsageError(f"{flag} {path}: cannot make its folder ({exc.strerror or exc})") from None
    if not os.access(folder, os.W_OK):
        raise CLIUsageError(f"{flag} {path}: its folder {str(folder)!r} is not writable")


# -------------------------------------------------------------------------------------------------- plug-in

@dataclass
class RunContext:
    """What a plug-in's ``run`` gets: the parsed ``args``, the run's ``meta`` (add to it), ``extra`` (further
    top-level sections of the JSON document, e.g. placements), and :meth:`progress` / :meth:`save`."""

    args: argparse.Namespace
    meta: dict
    bench: "Benchmark"
    extra: dict = field(default_factory=dict)

    def progress(self, total: int, description: str = "", *, enabled: bool = True, header: str | None = None,
                 mode: str = "auto") -> Progress:
        """A :class:`Progress` on stderr (stdout holds only the table or the JSON document)."""
        return Progress(total, description or self.bench.name, enabled=enabled, header=header, mode=mode)

    def document(self, rows: Sequence[Any]) -> dict:
        """The JSON document of ``rows``: ``{"meta": ..., <extra sections>, "rows": [...]}``."""
        return {"meta": self.meta, **self.extra, "rows": [as_row(r) for r in rows]}

    def json_paths(self) -> list[Path]:
        paths = [Path(self.args.json_path)] if getattr(self.args, "json_path", None) else []
        if getattr(self.args, "out_dir", None):
            paths.append(Path(self.args.out_dir) / f"{self.bench.stem}.json")
        return paths

    def save(self, rows: Sequence[Any]) -> None:
        """Write the JSON document of the rows so far (a long sweep stopped part-way keeps what it measured)."""
        text = json.dumps(self.document(rows), indent=1, default=str)
        for path in self.json_paths():
            path.write_text(text)


class Benchmark(ABC):
    """A benchmark plug-in (nccl-tests' ``testColl``); subclasses set the class attributes and ``run``.

    Attributes:
        name: the command name (``hpdl bench NAME``); ``stem`` names the files written to ``--out``.
        title: one line saying what is measured (the table's heading).
        columns: the table's :class:`Column` s.
        plot_spec: the figure (:class:`PlotSpec`), or None for no figure (or override :meth:`plot`).
        outputs: which of ``--format/--json/--out/--plot`` the command takes.
    """

    name: str = "bench"
    stem: str | None = None
    title: str = ""
    columns: tuple[Column, ...] = ()
    plot_spec: PlotSpec | None = None
    outputs: tuple[str, ...] = OUTPUTS
    out_help: str | None = None   # --out's help when it takes more than a folder (and its metavar, out_metavar)
    out_metavar: str = "DIR"

    def __init__(self) -> None:
        if self.stem is None:
            self.stem = self.name

    # ---- what a plug-in gives
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """The benchmark's own flags (the harness adds the output flags)."""

    def validate(self, args) -> None:
        """Check and normalise ``args`` before anything runs; raise :class:`CLIUsageError` naming the flag."""

    def metadata(self, args) -> dict:
        """Settings recorded in the run's metadata besides the harness's own (:func:`run_metadata`)."""
        return {}

    def output_files(self, args) -> list[tuple[str, str | None]]:
        """``(flag, path)`` of files the plug-in writes itself (e.g. ``--tune``), checked with the harness's."""
        return []

    @abstractmethod
    def run(self, ctx: RunContext) -> list | None:
        """Measure and return the rows (dicts keyed by :attr:`columns`' keys), or None when nothing ran."""

    def invocation(self, ctx: RunContext) -> str:
        """The command as the user typed it, without its options (``hpdl moe bench``, ``hpdl bench moe``,
        ``hpdl bench all_reduce``), from ``meta["command"]``; ``hpdl bench NAME`` when not run by ``hpdl``."""
        return invocation(ctx.meta, f"hpdl bench {self.name}")

    def table(self, rows: Sequence[Any], ctx: RunContext) -> str:
        """The text printed last: a heading line (the command as typed, :meth:`invocation`) and
        :func:`format_table` of :attr:`columns`."""
        meta = ctx.meta
        cmd = self.invocation(ctx)
        head = f"# {cmd}: {self.title}; " if self.title else f"# {cmd}: "
        head += f"device {meta.get('device', 'cpu')}, torch {meta['torch']}, {meta['date']}"
        return head + "\n" + format_table(rows, self.columns)

    def plot(self, rows: Sequence[Any], path: str | Path, ctx: RunContext) -> list[str]:
        """Draw the figure(s) into ``path`` (a PNG file, or with ``--out`` a folder); returns what was written."""
        if self.plot_spec is None:
            return []
        target = Path(path) / f"{self.stem}.png" if Path(path).is_dir() else Path(path)
        return [plot_rows(rows, self.plot_spec, target, self.plot_title(ctx))]

    def plot_title(self, ctx: RunContext) -> str:
        meta = ctx.meta
        return f"{self.title}; {meta.get('gpu') or meta.get('device', 'cpu')}, torch {meta['torch']}, {meta['date']}"

    def failed(self, rows: Sequence[Any], ctx: RunContext) -> bool:
        """True when the run must exit 1: by default any row with a non-zero ``wrong``."""
        return any(as_row(r).get("wrong") for r in rows)

    def finish(self, rows: Sequence[Any], ctx: RunContext) -> int:
        """Work after the report (e.g. a tuning table); its exit status is combined with :meth:`failed`'s."""
        return 0


EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2   # EXIT_USAGE is argparse's status for bad usage


def usage_checks(bench: Benchmark, args) -> None:
    """Everything checked before a run: :meth:`Benchmark.validate`, then the output paths (:func:`check_outputs`).

    Raises:
        CLIUsageError: with ``exit_status`` :data:`EXIT_USAGE` (2, as argparse's own errors), so that the
            ``hpdl`` command's 1 means only that a run failed or a row is wrong.
    """
    try:
        bench.validate(args)
        check_outputs(args, bench.output_files(args))
    except CLIUsageError as exc:
        exc.exit_status = EXIT_USAGE
        raise


def main(bench: Benchmark, args) -> int:
    """Run ``bench`` with the parsed ``args``: check usage (:func:`usage_checks`), run, then report (stdout table
    or JSON, ``--json``, ``--out``, ``--plot``) and return the exit status (0 ok, 1 :meth:`Benchmark.failed`;
    a usage error raises :class:`CLIUsageError`, which the ``hpdl`` command turns into exit status 2)."""
    usage_checks(bench, args)
    extra = bench.metadata(args)
    device = extra.pop("device", getattr(args, "device", None))
    # the command as typed: `hpdl ...` passes its argv (also when main(argv) is called in-process)
    ctx = RunContext(args, run_metadata(device=device, command=getattr(args, "_command", None), **extra), bench)
    t0 = time.perf_counter()
    rows = bench.run(ctx)
    if rows is None:  # a rank that does not report
        return 0
    ctx.meta.setdefault("seconds", round(time.perf_counter() - t0, 1))
    return report(bench, rows, ctx)


def report(bench: Benchmark, rows: Sequence[Any], ctx: RunContext) -> int:
    """Everything after ``run``: files, then stdout, then the exit status."""
    args = ctx.args
    ctx.save(rows)
    written = [str(p) for p in ctx.json_paths()]
    if getattr(args, "out_dir", None):
        written += bench.plot(rows, Path(args.out_dir), ctx)
    if getattr(args, "plot_path", None):
        written += bench.plot(rows, args.plot_path, ctx)
    if getattr(args, "format", "table") == "json":
        print(json.dumps(ctx.document(rows), indent=1, default=str))
    else:
        print(bench.table(rows, ctx))
        if written:
            print(f"# wrote {' '.join(written)}")
    status = 1 if bench.failed(rows, ctx) else 0
    return max(status, int(bench.finish(rows, ctx) or 0))


def command(bench_cls: type[Benchmark]) -> type:
    """The command class for ``bench_cls`` that ``hpdl``'s registries load (``add_arguments(parser)`` with the
    output flags, ``run(args) -> int`` through :func:`main`)."""

    class _Command:
        benchmark = bench_cls

        @staticmethod
        def add_arguments(parser: argparse.ArgumentParser) -> None:
            bench_cls.add_arguments(parser)
            add_output_arguments(parser, bench_cls.outputs, stem=bench_cls.stem or bench_cls.name,
                                 out_help=bench_cls.out_help, out_metavar=bench_cls.out_metavar)

        def run(self, args) -> int:
            return main(bench_cls(), args)

    _Command.__name__ = _Command.__qualname__ = f"{bench_cls.__name__}Command"
    _Command.__doc__ = f"``hpdl bench {bench_cls.name}``: :class:`{bench_cls.__name__}` on the harness."
    return _Command
