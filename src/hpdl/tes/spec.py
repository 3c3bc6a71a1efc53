"""``hpdl tes spec``: reproduce every figure of the abstract with the model, spec vs modelled, pass/fail.

Each check builds a bench or montage, simulates it with the default (assumed) chip parameters and measures
the figure the way a bench would: DC codes into a resistor, a 2.5 mA request into 500 kOhm, the common mode
of an HD montage with drawn mismatch, an impedance sweep over 0.5-500 kOhm, a short circuit for the OCP,
and the TI envelope of two chips. Nothing is asserted from the parameters; every value is measured on
simulated waveforms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from hpdl.tes.channel import ChipClock, DacParams
from hpdl.tes.cmvh import CmvhParams
from hpdl.tes.load import Electrode, Tissue, randles_impedance
from hpdl.tes.ocp import OcpParams
from hpdl.tes.scenario import Fault, Scenario, TiPair
from hpdl.tes.simulate import simulate
from hpdl.tes.waveforms import Arbitrary, Dc, Sine

CM_BOUND_MV = 10.0  # our reading of "near 0 V" (the abstract gives no number): |DC common mode| <= 10 mV
Z_MIN, Z_MAX = 500.0, 500e3


@dataclass
class SpecRow:
    """One line of the spec table."""

    item: str
    spec: str
    modelled: str
    ok: bool | None  # None: informational row
    detail: dict = field(default_factory=dict)


def bench(load: Electrode, waveform, duration_s: float, fs_hz: float, **kw) -> Scenario:
    """Bench scenario: one channel drives ``load`` against a near-ideal return electrode ("ref", 1 Ohm) that
    the CMVH switch ties to ground; tissue is 0.5 Ohm per electrode. ``kw`` overrides Scenario fields."""
    ref = Electrode("ref", r_s_ohm=1.0, r_ct_ohm=0.0, c_dl_f=0.0)
    base = dict(electrodes=[load, ref], channels=["ch0"], channel_terminal=[0], waveforms=[waveform],
                duration_s=duration_s, fs_hz=fs_hz, tissue=Tissue(r_spread_ohm=0.5), reference=1)
    base.update(kw)
    return Scenario(**base)


def check_dac(seed: int = 0) -> list[SpecRow]:
    """Every code held for 1 ms into 1 kOhm after calibration; steps from the delivered pin currents."""
    p = DacParams()
    codes = np.arange(-p.max_code, p.max_code + 1)
    hold, fs = 1e-3, 20e3
    w = Arbitrary(samples_a=tuple(codes * p.lsb_a), sample_rate_hz=1 / hold, repeat=False)
    res = simulate(bench(Electrode("R1k", 1000.0, 0.0, 0.0), w, codes.size * hold, fs, seed=seed))
    per = int(round(hold * fs))
    i = res.i_electrode_a[:, 0].reshape(codes.size, per)[:, per // 4:].mean(axis=1)  # skip settling
    steps = np.diff(i) * 1e6
    ok_step = bool(np.all(steps > 0.5 * 10) and np.all(steps < 1.5 * 10) and abs(steps.mean() - 10) < 0.1)
    lo, hi = i[0] * 1e3, i[-1] * 1e3
    ok_range = abs(lo + 2.5) < 0.025 and abs(hi - 2.5) < 0.025
    return [SpecRow("current step (10 uA LSB, all 501 codes)", "10 uA",
                    f"{steps.mean():.3f} uA mean, {steps.min():.2f}..{steps.max():.2f} uA", ok_step,
                    {"steps_ua": steps.tolist()}),
            SpecRow("current range", "-2.5..+2.5 mA", f"{lo:.4f}..{hi:.4f} mA", ok_range)]


def check_compliance(seed: int = 0) -> list[SpecRow]:
    """2.5 mA (both signs) requested into 500 kOhm must stop at 13 V (<= 26 uA, flagged); 2.5 mA into
    5 kOhm must not clip."""
    rows = []
    for amp in (2.5e-3, -2.5e-3):
        res = simulate(bench(Electrode("R500k", 500e3, 0.0, 0.0), Dc(amplitude_a=amp), 2e-3, 100e3, seed=seed))
        i = float(np.abs(res.i_electrode_a[:, 0]).max())
        v = float(np.abs(res.v_terminal_v[:, 0]).max())
        flagged = bool(res.clipped[:, 0].all())
        rows.append(SpecRow(f"compliance, {amp * 1e3:+.1f} mA into 500 kOhm", "|V| <= 13 V, I <= 26 uA, flagged",
                            f"|V| = {v:.3f} V, I = {i * 1e6:.2f} uA, flagged = {flagged}",
                            v <= 13.0 + 1e-6 and i <= 26e-6 and flagged))
    res = simulate(bench(Electrode("R5k", 5e3 - 2.0, 0.0, 0.0), Dc(amplitude_a=2.5e-3), 2e-3, 100e3, seed=seed))
    v = float(np.abs(res.v_terminal_v[:, 0]).max())
    rows.append(SpecRow("full scale into 5 kOhm (12.5 V)", "no clipping", f"|V| = {v:.3f} V, clipped = "
                        f"{bool(res.clipped.any())}", not res.clipped.any() and v <= 13.0))
    return rows


def hd_montage(kind: str, cmvh: CmvhParams, seed: int, duration_s: float) -> Scenario:
    """HD-TES montages with a CMVH reference "Cz": ``"4x1"`` (10 Hz tACS, 1 mA centre, four -0.25 mA
    returns on 5 channels) or ``"ti"`` (2 chips, pairs at 2000/2010 Hz, 1 mA)."""
    rng = np.random.default_rng(1000 + seed)  # electrode spread: +-20 % around the nominal values
    def el(name, area=1.1):
        k = rng.uniform(0.8, 1.2, 2)
        return Electrode(name, 1000.0 * k[0], 5000.0 * k[1], 0.5e-6, area, name)
    if kind == "4x1":
        names = ["C3", "FC1", "FC5", "CP1", "CP5"]
        els = [el(n) for n in names] + [el("Cz", 3.1)]
        waves = [Sine(amplitude_a=1e-3, freq_hz=10.0, ramp_up_s=0.02)] + \
            [Sine(amplitude_a=0.25e-3, freq_hz=10.0, phase_rad=math.pi, ramp_up_s=0.02)] * 4
        return Scenario(els, names, list(range(5)), waves, duration_s, 20e3, reference=5, cmvh=cmvh, seed=seed)
    names = ["F3", "P3", "F4", "P4"]
    els = [el(n) for n in names] + [el("Cz", 3.1)]
    waves = [Sine(amplitude_a=1e-3, freq_hz=f, phase_rad=ph, ramp_up_s=0.02)
             for f in (2000.0, 2010.0) for ph in (0.0, math.pi)]
    return Scenario(els, ["A1", "A2", "B1", "B2"], [0, 1, 2, 3], waves, duration_s, 100e3, channel_chip=[0, 0, 1, 1],
                    clocks=[ChipClock(), ChipClock()], reference=4, cmvh=cmvh, seed=seed,
                    ti_pairs=(TiPair("deep", (0, 1), (2, 3), 2000.0, 2010.0, 1e-3, 1e-3),))


def check_cmvh(seeds=(0, 1, 2, 3, 4), duration_s: float = 0.3) -> list[SpecRow]:
    """Largest |DC common mode| over windows, across drawn chips, for each CMVH setting and montage."""
    rows, worst = [], {}
    modes = {"calibration + switch": CmvhParams(), "switch only": CmvhParams(calibrate=False),
             "calibration only": CmvhParams(switch=False), "off": CmvhParams(calibrate=False, switch=False)}
    for mode, cm in modes.items():
        vals = []
        for kind in ("4x1", "ti"):
            for s in (seeds if mode == "calibration + switch" else seeds[:1]):
                sc = hd_montage(kind, cm, s, duration_s if mode == "calibration + switch" else 0.1)
                if not cm.switch:
                    sc = replace(sc, reference=None)
                vals.append(1e3 * simulate(sc).common_mode["max_abs_dc_v"])
        worst[mode] = max(vals)
    ok = worst["calibration + switch"] <= CM_BOUND_MV
    rows.append(SpecRow("common mode, HD-TES (4x1 tACS and TI), CMVH on", f"near 0 V (<= {CM_BOUND_MV:g} mV)",
                        f"max |V_cm| = {worst['calibration + switch']:.3f} mV over {2 * len(seeds)} runs", ok))
    def fmt(v_mv: float) -> str:
        if v_mv < 1e3:
            return f"{v_mv:.3g} mV"
        return f"{v_mv / 1e3:.3g} V" + (" (beyond compliance)" if v_mv > 13e3 else "")

    rows.append(SpecRow("same montages, CMVH variants (contrast)", "-",
                        ", ".join(f"{m}: {fmt(v)}" for m, v in worst.items() if m != "calibration + switch"),
                        None, {"max_abs_mv": worst}))
    return rows


def measure_load(load: Electrode, freq_hz: float, seed: int = 0, headroom: float = 0.8, **kw) -> dict:
    """Auto-ranged impedance measurement of ``load`` at ``freq_hz`` during tACS, as the chip would do it.

    A one-code (10 uA) probe gives a coarse |Z|; the stimulation amplitude is then the largest 10 uA multiple
    (max 1 mA) with ``|Z| I <= headroom x 13 V``, lowered one step at a time while the compliance flag is
    raised. The reported value is the last of three whole-period windows (the first absorbs the double
    layer's start-up transient). ``kw`` overrides Scenario fields (e.g. ``dac=DacParams(...)``).
    Returns the measured and true |Z| and phase.
    """
    fs = max(20e3, 50 * freq_hz)
    win = max(0.05, 5.0 / freq_hz)
    lsb = DacParams().lsb_a
    probe = simulate(bench(load, Sine(amplitude_a=lsb, freq_hz=freq_hz), 2 * win, fs, im_window_s=win, seed=seed, **kw))
    z0 = probe.impedance_log[-1]["z_abs_ohm"]
    amp = max(lsb, math.floor(min(1e-3, headroom * 13.0 / z0) / lsb + 1e-9) * lsb)
    while True:
        res = simulate(bench(load, Sine(amplitude_a=amp, freq_hz=freq_hz), 3 * win, fs, im_window_s=win, seed=seed,
                                 **kw))
        if not res.clipped.any() or amp <= lsb:
            break
        amp -= lsb
    row = res.impedance_log[-1]
    return {"freq_hz": freq_hz, "amplitude_ua": amp * 1e6, "z_true_ohm": row["z_true_abs_ohm"],
            "z_ohm": row["z_abs_ohm"], "error_pct": row["error_pct"],
            "phase_err_deg": row["phase_deg"] - row["z_true_phase_deg"], "clipped": bool(res.clipped.any())}


def impedance_loads(n: int = 24, freq_hz: float = 100.0) -> list[Electrode]:
    """``n`` loads whose |Z| at ``freq_hz`` (with the bench's 2 Ohm) is log-spaced over 0.5-500 kOhm,
    alternating resistors and Randles circuits (R_s = 0.3 R, R_ct = 0.7 R, double-layer corner 200 Hz,
    R scaled so that |Z(freq_hz)| lands on the grid)."""
    loads = []
    for k, z in enumerate(np.geomspace(Z_MIN, Z_MAX, n)):
        if k % 2 == 0:
            loads.append(Electrode(f"R{z:.0f}", z - 2.0, 0.0, 0.0))
        else:
            unit = abs(randles_impedance(freq_hz, 0.3, 0.7, 1.0 / (2 * np.pi * 200.0 * 0.7)))
            r = (z - 2.0) / unit
            loads.append(Electrode(f"Randles{z:.0f}", 0.3 * r, 0.7 * r, 1.0 / (2 * np.pi * 200.0 * 0.7 * r)))
    return loads


def check_impedance(freqs=(10.0, 100.0, 1000.0, 2000.0), n_loads: int = 24, seeds=(0,),
                    progress=None) -> tuple[list[SpecRow], list[dict]]:
    """Impedance sweep: every load x frequency x chip seed; spec row plus all points (for the plot)."""
    points = []
    total = n_loads * len(freqs) * len(seeds)
    for s in seeds:
        for f in freqs:
            for load in impedance_loads(n_loads, f):
                points.append(measure_load(load, f, seed=s) | {"load": load.name, "seed": s})
                if progress is not None:
                    progress(len(points) / total)
    worst = max(abs(p["error_pct"]) for p in points)
    zs = [p["z_true_ohm"] for p in points]
    row = SpecRow("impedance error, 0.5-500 kOhm", "< 5 %",
                  f"max |error| = {worst:.2f} % ({len(points)} points, |Z| {min(zs):.0f}-{max(zs):.0f} Ohm, "
                  f"{len(freqs)} freqs, {len(seeds)} chips)", worst < 5.0, {"n_points": len(points)})
    return [row], points


def check_impedance_in_montage(seeds=(0, 1, 2), duration_s: float = 0.5) -> list[SpecRow]:
    """Impedance log of every driven electrode of the TI montage (two carriers, four channels, CMVH on),
    after the first window, against the AC oracle of the same circuit."""
    errs = []
    for s in seeds:
        res = simulate(replace(hd_montage("ti", CmvhParams(), s, duration_s), im_window_s=0.1))
        first = min(r["t_s"] for r in res.impedance_log)
        errs += [abs(r["error_pct"]) for r in res.impedance_log if r["t_s"] > first]
    worst = max(errs)
    return [SpecRow("impedance during TI, HD montage (per electrode)", "< 5 %",
                    f"max |error| = {worst:.2f} % ({len(errs)} windows, {len(seeds)} chips)", worst < 5.0)]


def check_ocp(seed: int = 0) -> list[SpecRow]:
    """Short to a +15 V rail through 10 Ohm during 1 mA tACS into 1 kOhm; and no trip at 2.5 mA full scale."""
    ocp = OcpParams()
    fs, t_f = 10e6, 1e-3
    res = simulate(bench(Electrode("R1k", 1000.0, 0.0, 0.0), Sine(amplitude_a=1e-3, freq_hz=100.0), 2e-3, fs,
                         faults=(Fault(0, t_f, v_rail_v=15.0, r_ohm=10.0),), seed=seed))
    ev = res.ocp_events
    if ev:
        k_off = int(np.argmax(~res.enabled[:, 0]))
        latency = res.t_s[k_off] - t_f
        after = float(np.abs(res.i_electrode_a[k_off:, 0]).max())
    else:
        latency, after = math.inf, math.nan
    ok = bool(ev) and latency <= ocp.response_time_s and after < 1e-6
    rows = [SpecRow("OCP on a short circuit (15 V via 10 Ohm)", f"trip <= {ocp.response_time_s * 1e6:g} us, latched",
                    f"{latency * 1e6:.2f} us to off, {after * 1e6:.3g} uA after", ok)]
    res = simulate(bench(Electrode("R1k", 1000.0, 0.0, 0.0), Dc(amplitude_a=2.5e-3), 5e-3, 1e6, seed=seed))
    rows.append(SpecRow("OCP at full scale 2.5 mA", "no trip", f"{len(res.ocp_events)} trips", not res.ocp_events))
    return rows


def check_ti(seed: int = 0, duration_s: float = 0.5) -> list[SpecRow]:
    """Two chips, 2000/2010 Hz, 1 mA: envelope frequency and depth; then chip 1's clock skewed by 100 ppm."""
    rows = []
    for ppm in (0.0, 100.0):
        sc = replace(hd_montage("ti", CmvhParams(), seed, duration_s), clocks=[ChipClock(), ChipClock(ppm=ppm)])
        ti = simulate(sc).ti[0]
        df_err = abs(ti["delta_f_measured_hz"] - ti["delta_f_expected_hz"])
        depth_err = abs(ti["depth_measured_a"] / ti["depth_expected_a"] - 1)
        label = "shared clock" if ppm == 0 else f"chip 1 clock +{ppm:g} ppm"
        rows.append(SpecRow(f"TI from two chips, {label}", f"dF = {ti['delta_f_expected_hz']:.3f} Hz, depth 2 mA",
                            f"dF = {ti['delta_f_measured_hz']:.3f} Hz, depth = {1e3 * ti['depth_measured_a']:.3f} mA",
                            df_err < 0.01 and depth_err < 0.02))
    return rows


def run_all(progress=None, impedance_seeds=(0, 1, 2)) -> tuple[list[SpecRow], list[dict]]:
    """All checks; returns (rows, impedance points)."""
    rows = check_dac() + check_compliance()
    imp_rows, points = check_impedance(seeds=impedance_seeds, progress=progress)
    rows += imp_rows + check_impedance_in_montage() + check_cmvh() + check_ocp() + check_ti()
    return rows, points


def plot_impedance(points: list[dict], path) -> None:
    """Impedance error (%) vs true |Z| per frequency, with the +-5 % spec band; PNG at ``path``."""
    from hpdl.bench.common import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, f in enumerate(sorted({p["freq_hz"] for p in points})):
        sel = sorted((p for p in points if p["freq_hz"] == f), key=lambda p: p["z_true_ohm"])
        ax.semilogx([p["z_true_ohm"] for p in sel], [p["error_pct"] for p in sel], "o", ms=3, color=f"C{k}",
                    label=f"{f:g} Hz")
    ax.axhspan(-5, 5, color="g", alpha=0.08, label="spec +-5 %")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("true |Z| of the load (Ohm)")
    ax.set_ylabel("|Z| measurement error (%)")
    ax.set_title("Impedance measured during tACS (model, default noise, auto-ranged amplitude)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
