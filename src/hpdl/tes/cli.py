"""``hpdl tes``: simulate a protocol, check its safety, or reproduce the chip's specification.

    hpdl tes simulate [PROTOCOL.yaml] [--out DIR]      # default: the packaged example protocol
    hpdl tes check    [PROTOCOL.yaml]                  # static safety check, exit 1 on a failed check
    hpdl tes spec     [--out DIR] [--quick]            # spec vs modelled table + impedance-error plot

Exit status of ``check`` and ``simulate``: 0 every check passed, 1 a check failed (the protocol is not safe as
written), 2 the protocol could not be checked (missing file, invalid YAML or content; the message names the
field).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

from hpdl.bench.common import add_output_arguments, run_metadata
from hpdl.runtime.commands import CommandGroup


def _table(title: str, columns: list[str], rows: list[list], fmt: str) -> None:
    if fmt == "json":
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[x if isinstance(x, str) else (f"{x:.4g}" if isinstance(x, float) else str(x)) for x in r])
    Console().print(t)


def _checks_rows(checks):
    return [[c["name"], c["value"], c["limit"], c["unit"], "PASS" if c["ok"] else "FAIL"] for c in checks]


class TesCommand(CommandGroup):
    """CLI group ``tes`` (see module docstring)."""

    dest, subcommands = "tes_cmd", ("simulate", "check", "spec")

    @classmethod
    def add_arguments(cls, parser) -> None:
        sub = cls.subparsers(parser)
        p = sub.add_parser("simulate", help="run a protocol through the chip model; write JSON, NPZ and PNG")
        p.add_argument("protocol", nargs="?", default=None, help="protocol YAML (default: packaged example)")
        p.add_argument("--out", default="tes_out", help="output folder (default: ./tes_out)")
        p.add_argument("--seed", type=int, default=None,
                       help="override the protocol's mismatch/noise seed (default: the protocol's `seed`)")
        add_output_arguments(p, ("format",))
        p = sub.add_parser("check", help="static safety check of a protocol (no simulation)")
        p.add_argument("protocol", nargs="?", default=None, help="protocol YAML (default: packaged example)")
        add_output_arguments(p, ("format",))
        p = sub.add_parser("spec", help="model vs the abstract's figures; impedance-error plot")
        p.add_argument("--out", default="tes_spec",
                       help="folder for tes_spec.json and tes_spec_impedance.png (default: ./tes_spec)")
        p.add_argument("--page", default=None,
                       help="write the results page (markdown) here instead of OUT/tes_spec.md; a '## History' "
                            "section already in that file is kept (default: OUT/tes_spec.md)")
        p.add_argument("--quick", action="store_true",
                       help="one chip in the impedance sweep instead of three (default: three)")
        add_output_arguments(p, ("format",))

    def run(self, args) -> int:
        from hpdl.tes.protocol import ProtocolError

        cmd = getattr(args, self.dest, None)
        try:
            return super().run(args)
        except (ProtocolError, FileNotFoundError, IsADirectoryError) as exc:
            # 2, not 1: "could not check" must not read as "checked and failed"
            what = f"protocol file not found: {exc.filename}" if isinstance(exc, FileNotFoundError) else str(exc)
            print(f"hpdl tes {cmd}: error: {what}", file=sys.stderr)
            return 2

    def _check(self, args) -> int:
        from hpdl.tes import protocol, safety

        rep = safety.check_protocol(protocol.load(args.protocol))
        if args.format == "json":
            print(json.dumps(rep, indent=2))
        else:
            _table(f"safety check: {rep['protocol']}", ["check", "value", "limit", "unit", "result"],
                   _checks_rows(rep["checks"]), args.format)
            for w in rep["warnings"]:
                print(f"warning: {w}")
            print(f"checked every sample of the protocol: {rep['duration_s']:g} s at {rep['sample_rate_hz']:g} Hz "
                  f"({rep['samples_checked']} samples per channel)")
        return 0 if rep["ok"] else 1

    def _simulate(self, args) -> int:
        from dataclasses import replace

        from rich.progress import Progress

        from hpdl.tes import protocol, report, safety
        from hpdl.tes.simulate import simulate

        spec = protocol.load(args.protocol)
        sc = protocol.to_scenario(spec)
        if args.seed is not None:
            sc = replace(sc, seed=args.seed)
        with Progress(transient=True, disable=args.format == "json") as bar:
            task = bar.add_task(f"simulating {spec.name}", total=1.0)
            res = simulate(sc, progress=lambda f: bar.update(task, completed=f))
        rep = safety.safety_report(res, spec.limits, static=safety.check_protocol(spec))
        paths = report.write_outputs(res, rep, args.out)
        if args.format == "json":
            print(json.dumps(report.summary(res, rep) | {"files": paths}, indent=2))
            return 0 if rep["ok"] else 1
        static = rep["static"]
        if not static["ok"]:
            _table(f"static check (as `hpdl tes check`): {spec.name}", ["check", "value", "limit", "unit",
                                                                          "result"],
                   _checks_rows(static["checks"]), args.format)
            for w in static["warnings"]:
                print(f"warning: {w}")
        _table(f"safety report: {spec.name}", ["check", "value", "limit", "unit", "result"],
               _checks_rows(rep["checks"]), args.format)
        if res.ti:
            _table("temporal interference", ["pair", "dF expected (Hz)", "dF measured (Hz)", "depth expected (mA)",
                                             "depth measured (mA)"],
                   [[t["name"], t["delta_f_expected_hz"], t["delta_f_measured_hz"], 1e3 * t["depth_expected_a"],
                     1e3 * t["depth_measured_a"]] for t in res.ti], args.format)
        pts = [[t["name"], f["point"], f["ti_max_v_per_m"], f.get("ti_along_v_per_m", "-")]
               for t in res.ti for f in t["fields"]]
        if pts:
            _table("TI modulation at field points (delivered amplitudes)",
                   ["pair", "point", "max over directions (V/m)", "along direction (V/m)"], pts, args.format)
        if res.impedance_log:
            last = {}
            for r in res.impedance_log:
                last[r["electrode"]] = r
            _table("impedance (last window per electrode)", ["electrode", "f (Hz)", "|Z| (Ohm)", "phase (deg)",
                                                             "model truth |Z|", "error (%)"],
                   [[r["electrode"], r["freq_hz"], r["z_abs_ohm"], r["phase_deg"], r["z_true_abs_ohm"],
                     r["error_pct"]] for r in last.values()], args.format)
        print("files: " + ", ".join(paths.values()))
        if not rep["ok"]:
            why = "the static check failed (see above)" if not static["ok"] else "a check on the waveforms failed"
            print(f"FAIL: {spec.name} is not safe to run as written: {why}")
        return 0 if rep["ok"] else 1

    def _spec(self, args) -> int:
        from rich.progress import Progress

        from hpdl.tes import spec

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        with Progress(transient=True, disable=args.format == "json") as bar:
            task = bar.add_task("impedance sweep", total=1.0)
            rows, points = spec.run_all(progress=lambda f: bar.update(task, completed=f),
                                        impedance_seeds=(0,) if args.quick else (0, 1, 2))
        elapsed = time.time() - t0
        png = out / "tes_spec_impedance.png"
        spec.plot_impedance(points, png)
        page = Path(args.page) if args.page else out / "tes_spec.md"
        page.parent.mkdir(parents=True, exist_ok=True)
        history = ""
        if page.exists() and "\n## History" in page.read_text():
            history = page.read_text().split("\n## History", 1)[1]
            history = "\n## History" + history
        cmd = "hpdl tes spec" + (f" --out {args.out}" if args.out != "tes_spec" else "") + \
            (f" --page {args.page}" if args.page else "") + (" --quick" if args.quick else "")
        meta = run_metadata(command=cmd, versions=("numpy", "scipy"))
        data = {"meta": meta, "rows": [r.__dict__ for r in rows], "impedance_points": points, "elapsed_s": elapsed}
        (out / "tes_spec.json").write_text(json.dumps(data, indent=1, default=float))
        md = _markdown(rows, os.path.relpath(png, page.parent), os.path.relpath(out / "tes_spec.json", page.parent),
                       elapsed, meta) + history
        page.write_text(md)
        if args.format == "json":
            print(json.dumps({"rows": [{k: v for k, v in r.__dict__.items() if k != "detail"} for r in rows]},
                             indent=2))
        else:
            _table("HD-TES SoC: specification vs model", ["item", "spec", "modelled", "result"],
                   [[r.item, r.spec, r.modelled, _verdict(r)] for r in rows], args.format)
            print(f"wrote {page}, {png}, {out / 'tes_spec.json'} ({elapsed:.1f} s)")
        return 0 if all(r.ok is not False for r in rows) else 1


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} CPU"


def _verdict(row) -> str:
    return "info" if row.ok is None else ("PASS" if row.ok else "FAIL")


def _markdown(rows, png_name: str, json_name: str, elapsed: float, meta: dict) -> str:
    lines = [
        "# hpdl.tes: chip specification vs behavioural model",
        "",
        f"Generated {meta['date']} by `{meta['command']}` in {elapsed:.1f} s on "
        f"{_cpu_name()} ({meta['cores']} logical CPUs, single process), Python {meta['python']}, "
        f"numpy {meta.get('numpy')}, scipy {meta.get('scipy')}. Model parameters are the defaults documented in "
        f"docs/tes.md (values the abstract does not give are assumptions). Data: `{json_name}`.",
        "",
        "| item | spec (abstract) | modelled | result |",
        "|---|---|---|---|",
    ]
    def cell(x: str) -> str:
        return x.replace("|", "\\|")

    for r in rows:
        lines.append(f"| {cell(r.item)} | {cell(r.spec)} | {cell(r.modelled)} | {_verdict(r)} |")
    lines += ["", f"![impedance error vs |Z|]({png_name})", "",
              "Notes. Every value is measured on simulated waveforms; nothing is read back from a parameter.",
              "* Current step/range: every code held 1 ms into 1 kOhm after calibration; the mean step and the "
              "range carry the common gain residual left by the calibration resistor's tolerance (0.1 %).",
              "* Impedance: bench loads (resistors and Randles circuits) whose |Z| at the test frequency is "
              "log-spaced over 0.5-500 kOhm, 10/100/1000/2000 Hz, amplitude auto-ranged (one-code probe, then "
              "|Z| I <= 0.8 x 13 V). The error grows towards 500 kOhm because the 50 MOhm output resistance "
              "shunts ~1 % of the current and the amplitude is only 20 uA there (2 codes, so DAC INL counts).",
              "* Common mode: drawn mismatch (1 % gain, 2 uA offset, 1 sigma), electrode values spread +-20 %; "
              "DC = mean of the pin voltages over whole common carrier periods after the ramp and the first "
              "window. \"near 0 V\" <= 10 mV is our reading; the abstract gives no number.",
              "* OCP: the pin is shorted to a 15 V rail through 10 Ohm at t = 1 ms, simulated at 10 MHz; time "
              "from the fault to the channel's output switch opening.",
              "* TI: two chips, 1 mA pairs at 2000 and 2010 Hz; envelope from the delivered pair currents "
              "(Hilbert, frequency fitted); the skewed clock moves dF by f2 x 100 ppm as expected.", ""]
    return "\n".join(lines)
