"""Outputs of a simulation: JSON summary, waveform archive (NPZ) and plots (PNG, matplotlib Agg)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hpdl.tes.scenario import SimResult


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def summary(res: SimResult, safety: dict) -> dict:
    """JSON-ready summary: protocol facts, safety report, TI analysis, impedance log, calibration."""
    sc = res.scenario
    cal = res.calibration
    return _jsonable({
        "duration_s": sc.duration_s, "sample_rate_hz": sc.fs_hz, "seed": sc.seed,
        "electrodes": [e.name for e in sc.electrodes], "channels": sc.channels,
        "reference": sc.electrodes[sc.reference].name if sc.reference is not None else None,
        "cmvh": {"calibrate": sc.cmvh.calibrate, "switch": sc.cmvh.switch},
        "calibration": None if cal is None else {
            "gain_est_pct": (100 * cal.gain_est).tolist(), "offset_est_ua": (1e6 * cal.offset_est_a).tolist(),
            "residual_gain_err_pct": (100 * ((1 + res.dac.gain_err) * (1 + res.dac.gain_trim) - 1)).tolist(),
            "residual_offset_ua": (1e6 * (res.dac.offset_a + res.dac.offset_trim_a)).tolist()},
        "safety": safety, "ti": res.ti, "impedance_log": res.impedance_log,
    })


def write_outputs(res: SimResult, safety: dict, out_dir: str | Path) -> dict[str, str]:
    """Write ``summary.json``, ``waveforms.npz`` and PNG plots under ``out_dir``; returns {kind: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"summary": out / "summary.json", "waveforms": out / "waveforms.npz"}
    paths["summary"].write_text(json.dumps(summary(res, safety), indent=2))
    sc = res.scenario
    np.savez_compressed(paths["waveforms"], t_s=res.t_s, i_electrode_a=res.i_electrode_a,
                        v_terminal_v=res.v_terminal_v, codes=res.codes, i_target_a=res.i_target_a,
                        clipped=res.clipped, enabled=res.enabled, electrodes=np.array([e.name for e in sc.electrodes]),
                        channels=np.array(sc.channels))
    paths.update(plot(res, out))
    paths["safety_png"] = plot_safety(safety, out / "safety.png")
    return {k: str(v) for k, v in paths.items()}


def plot_safety(safety: dict, path: Path) -> Path:
    """Bar charts of the safety report against its limits (red bars fail): per-channel peak current,
    compliance headroom and per-period charge imbalance, per-electrode current density."""
    from hpdl.bench.common import pyplot

    plt = pyplot()

    limit = {c["name"]: c["limit"] for c in safety["checks"]}
    ch = safety["channels"]
    names = [r["channel"] for r in ch]
    panels = [
        ("peak current (mA)", names, [r["peak_delivered_ma"] for r in ch], limit["max channel current"], "max"),
        ("compliance headroom (V)", names, [r["headroom_v"] for r in ch], limit["compliance headroom"], "min"),
        ("max charge per period (nC)", names, [r["max_period_charge_nc"] or 0.0 for r in ch],
         limit["charge imbalance per period"], "max"),
        ("peak current density (mA/cm^2)", [r["electrode"] for r in safety["electrodes"]],
         [r["peak_density_ma_cm2"] for r in safety["electrodes"]], limit["current density"], "max"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.5))
    for ax, (title, labels, values, lim, kind) in zip(axes, panels):
        ok = [(v <= lim) if kind == "max" else (v >= lim) for v in values]
        ax.bar(labels, values, color=["C2" if o else "C3" for o in ok])
        ax.axhline(lim, color="k", ls="--", lw=1, label=f"{kind} {lim:g}")
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        ax.legend(fontsize=7)
    verdict = "PASS" if safety["ok"] else "FAIL: " + ", ".join(c["name"] for c in safety["checks"] if not c["ok"])
    fig.suptitle(f"safety report: {verdict}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(res: SimResult, out_dir: Path) -> dict[str, Path]:
    """Waveforms (current, voltage, common mode), TI envelope and impedance log as PNG files."""
    from hpdl.bench.common import pyplot

    plt = pyplot()

    sc = res.scenario
    names = [e.name for e in sc.electrodes]
    paths = {}
    from hpdl.tes.cmvh import common_mode

    # zoom: 10 ms from the middle of the record (full records of kHz carriers are a solid band)
    k_mid = res.t_s.size // 2
    zoom = slice(k_mid, min(res.t_s.size, k_mid + max(16, int(0.01 * sc.fs_hz))))
    fig, ax = plt.subplots(4, 1, figsize=(10, 10))
    for e, nm in enumerate(names):
        ax[0].plot(1e3 * res.t_s[zoom], 1e3 * res.i_electrode_a[zoom, e], lw=0.8, label=nm)
        ax[1].plot(1e3 * res.t_s[zoom], res.v_terminal_v[zoom, e], lw=0.8, label=nm)
        ax[2].plot(res.t_s, res.v_terminal_v[:, e], lw=0.3)
    cm = common_mode(res.v_terminal_v, sc.fs_hz, res.common_mode.get("window_s", 0.01))
    win = res.common_mode.get("window_s", 0.01)
    ax[3].plot(res.t_s, 1e3 * cm["v_cm"], lw=0.3, color="0.6", label="mean pin voltage")
    ax[3].step(np.arange(cm["dc_windows"].size) * win, 1e3 * cm["dc_windows"], where="post", color="C3",
               label=f"DC (window {1e3 * win:g} ms)")
    ax[0].set_ylabel("electrode current (mA)")
    ax[1].set_ylabel("pin voltage (V)")
    ax[0].set_xlabel("time (ms), zoom")
    ax[1].set_xlabel("time (ms), zoom")
    ax[2].set_ylabel("pin voltage (V)")
    ax[2].set_xlabel("time (s)")
    ax[3].set_ylabel("common mode (mV)")
    ax[3].set_xlabel("time (s)")
    ax[0].legend(loc="upper right", fontsize=7, ncol=min(len(names), 6))
    ax[3].legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    paths["waveforms_png"] = out_dir / "waveforms.png"
    fig.savefig(paths["waveforms_png"], dpi=110)
    plt.close(fig)
    if sc.ti_pairs:
        from hpdl.tes.ti import measure_envelope

        fig, ax = plt.subplots(len(sc.ti_pairs), 1, figsize=(10, 3 * len(sc.ti_pairs)), squeeze=False)
        for a, p, info in zip(ax[:, 0], sc.ti_pairs, res.ti):
            def pair(chs):
                x, y = (sc.channel_terminal[c] for c in chs)
                return 0.5 * (res.i_electrode_a[:, x] - res.i_electrode_a[:, y])
            s = pair(p.channels_1) + pair(p.channels_2)
            a.plot(res.t_s, 1e3 * s, lw=0.3, color="0.6", label="sum of pair currents")
            a.plot(res.t_s, 1e3 * measure_envelope(s, sc.fs_hz)["envelope"], color="C3", label="envelope (Hilbert)")
            a.set_title(f"TI {p.name}: dF = {info['delta_f_measured_hz']:.3f} Hz, depth = "
                        f"{1e3 * info['depth_measured_a']:.3f} mA (expected {1e3 * info['depth_expected_a']:.3f})")
            a.set_ylabel("mA")
            a.legend(loc="upper right", fontsize=7)
        ax[-1, 0].set_xlabel("time (s)")
        fig.tight_layout()
        paths["ti_png"] = out_dir / "ti_envelope.png"
        fig.savefig(paths["ti_png"], dpi=110)
        plt.close(fig)
    if res.impedance_log:
        fig, ax = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
        for el in sorted({r["electrode"] for r in res.impedance_log}):
            rows = [r for r in res.impedance_log if r["electrode"] == el]
            tt = [r["t_s"] for r in rows]
            ax[0].plot(tt, [r["z_abs_ohm"] for r in rows], "o-", label=f"{el} measured")
            ax[0].plot(tt, [r["z_true_abs_ohm"] for r in rows], "k:", lw=0.8)
            ax[1].plot(tt, [r["phase_deg"] for r in rows], "o-", label=el)
        ax[0].set_ylabel("|Z| (Ohm); dotted: model truth")
        ax[1].set_ylabel("phase (deg)")
        ax[1].set_xlabel("time (s)")
        ax[0].legend(fontsize=7)
        fig.tight_layout()
        paths["impedance_png"] = out_dir / "impedance_log.png"
        fig.savefig(paths["impedance_png"], dpi=110)
        plt.close(fig)
    return paths
