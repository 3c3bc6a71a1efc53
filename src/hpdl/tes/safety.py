"""Safety checks: static (``hpdl tes check``, no circuit simulation) and on a simulation's waveforms.

Both produce the same kind of report: a list of checks ``{name, value, limit, unit, ok}`` plus per-channel
and per-electrode rows. Limits come from the protocol's ``limits`` block (defaults are model assumptions).

Definitions (all on pin currents, i.e. the current into each electrode):
* per-period charge balance: net charge over each whole repetition period of a periodic waveform, nC;
* total current: the largest instantaneous sum of the currents *leaving* the chip (positive pins), mA;
* current density: peak |current| / electrode area, mA/cm^2;
* compliance headroom: compliance voltage minus the largest |pin voltage|, V.
"""

from __future__ import annotations

import numpy as np

from hpdl.tes.channel import quantize
from hpdl.tes.network import Network
from hpdl.tes.protocol import LimitsSpec, ProtocolSpec, to_scenario
from hpdl.tes.simulate import G_LEAK_S, Scenario, SimResult
from hpdl.tes.waveforms import Sine

_MAX_CHECK_SAMPLES = 2_000_000


def period_charges(i_a: np.ndarray, fs_hz: float, period_s: float) -> np.ndarray:
    """Net charge (C) in each whole period of ``period_s`` of a current ``i_a`` (K,) A sampled at ``fs_hz``.

    Uses the cumulative charge interpolated at period boundaries, so the period need not be a whole number
    of samples. Returns (P,) float64 (empty when the record is shorter than one period).
    """
    q = np.concatenate([[0.0], np.cumsum(np.asarray(i_a, dtype=np.float64)) / fs_hz])
    tq = np.arange(q.size) / fs_hz
    n_per = int(np.floor(tq[-1] / period_s + 1e-9))
    if n_per < 1:
        return np.zeros(0)
    qb = np.interp(np.arange(n_per + 1) * period_s, tq, q)
    return np.diff(qb)


def _check(name, value, limit, unit, ok) -> dict:
    return {"name": name, "value": float(value), "limit": float(limit), "unit": unit, "ok": bool(ok)}


def _ground_nominal(sc: Scenario) -> np.ndarray:
    g = np.full(len(sc.electrodes), G_LEAK_S)
    g[np.asarray(sc.channel_terminal)] += 1.0 / sc.dac.r_out_ohm
    if sc.cmvh.switch and sc.reference is not None:
        g[sc.reference] += 1.0 / sc.cmvh.r_switch_ohm
    return g


def predicted_peak_voltages(sc: Scenario) -> np.ndarray:
    """Upper bound of each pin's |voltage| (N,) V with the nominal (drift-free) load: the sum over the
    sinusoidal components and the DC/slow part of the AC-solved pin voltage magnitudes."""
    net = Network(sc.electrodes, sc.tissue, sc.channel_terminal)
    g = _ground_nominal(sc)
    c = len(sc.channels)
    by_f: dict[float, np.ndarray] = {}
    slow = np.zeros(c)
    for ch, w in enumerate(sc.waveforms):
        if isinstance(w, Sine):
            by_f.setdefault(w.freq_hz, np.zeros(c, complex))[ch] += w.amplitude_a * np.exp(1j * w.phase_rad)
            slow[ch] += w.offset_a
        else:
            slow[ch] += np.sign(_signed_peak(w)) * w.peak_a
    total = np.zeros(len(sc.electrodes))
    for f, pattern in by_f.items():
        total += np.abs(net.ac(f, pattern, g)[0])
    if np.any(slow):
        total += np.abs(net.ac(1e-3, slow.astype(complex), g)[0])  # ~DC: double layer fully charged
    return total


def _signed_peak(w) -> float:
    x = w.shape(np.linspace(0, 1, 64)) if not isinstance(w, Sine) else np.array([w.peak_a])
    return float(x[np.argmax(np.abs(x))]) if x.size else 0.0


def check_protocol(p: ProtocolSpec) -> dict:
    """Static safety check of a validated protocol (waveforms on the DAC grid, ideal DAC, nominal load).

    Returns a dict: ``ok``, ``checks`` (list of check dicts), ``warnings`` (list of str), ``channels`` and
    ``electrodes`` (lists of row dicts). Long protocols are checked over their first 2e6 samples.
    """
    sc = to_scenario(p)
    lim: LimitsSpec = p.limits
    k = min(int(round(sc.duration_s * sc.fs_hz)), _MAX_CHECK_SAMPLES)
    t = np.arange(k) / sc.fs_hz
    chips = sc.channel_chip or [0] * len(sc.channels)
    target = np.stack([w(sc.clocks[chips[ch]].chip_time(t), sc.duration_s) for ch, w in enumerate(sc.waveforms)], 1)
    i = quantize(target, sc.dac) * sc.dac.lsb_a
    warnings: list[str] = []
    checks: list[dict] = []
    if k < int(round(sc.duration_s * sc.fs_hz)):
        warnings.append(f"only the first {k / sc.fs_hz:.3g} s of {sc.duration_s} s were checked")
    rows = []
    vpk = predicted_peak_voltages(sc)
    for ch, name in enumerate(sc.channels):
        w = sc.waveforms[ch]
        e = sc.channel_terminal[ch]
        peak_req = float(np.abs(target[:, ch]).max())
        q = period_charges(i[:, ch], sc.fs_hz, w.period_s) if w.period_s else np.zeros(0)
        rows.append({"channel": name, "electrode": sc.electrodes[e].name, "peak_ma": 1e3 * peak_req,
                     "peak_after_dac_ma": 1e3 * float(np.abs(i[:, ch]).max()), "dc_ua": 1e6 * float(i[:, ch].mean()),
                     "max_period_charge_nc": 1e9 * float(np.abs(q).max()) if q.size else None,
                     "predicted_peak_v": float(vpk[e]), "headroom_v": sc.dac.compliance_v - float(vpk[e])})
        if peak_req > sc.dac.full_scale_a * (1 + 1e-9):
            warnings.append(f"channel {name}: {1e3 * peak_req:.3f} mA exceeds the DAC range and would saturate")
        step = np.abs(target[:, ch] - i[:, ch]).max()
        steps = w.amplitude_a / sc.dac.lsb_a if isinstance(w, Sine) else 0.0
        if steps and abs(steps - round(steps)) > 1e-6:
            warnings.append(f"channel {name}: amplitude is not a multiple of 10 uA (max rounding {1e6 * step:.1f} uA)")
    peak_ch = max(r["peak_ma"] for r in rows)
    # the chip's own range is a hard limit that a protocol's `limits` cannot raise
    full_ma = 1e3 * sc.dac.full_scale_a
    checks.append(_check("requested current within the chip's DAC range", peak_ch, full_ma, "mA",
                         peak_ch <= full_ma * (1 + 1e-9)))
    checks.append(_check("max channel current", peak_ch, lim.max_channel_current_ma, "mA",
                         peak_ch <= lim.max_channel_current_ma + 1e-9))
    total = float(np.clip(target, 0, None).sum(axis=1).max()) * 1e3  # as requested, like the channel peaks
    checks.append(_check("total current", total, lim.max_total_current_ma, "mA",
                         total <= lim.max_total_current_ma + 1e-9))
    qmax = max([r["max_period_charge_nc"] or 0.0 for r in rows])
    checks.append(_check("charge imbalance per period", qmax, lim.max_charge_imbalance_nc, "nC",
                         qmax <= lim.max_charge_imbalance_nc))
    headroom = min(r["headroom_v"] for r in rows)
    checks.append(_check("compliance headroom (predicted)", headroom, lim.min_compliance_headroom_v, "V",
                         headroom >= lim.min_compliance_headroom_v))
    residual = np.abs(i.sum(axis=1)).max()
    if residual > 0.5 * sc.dac.lsb_a:
        where = f"the reference {sc.electrodes[sc.reference].name}" if sc.reference is not None else "nowhere"
        warnings.append(f"channel currents do not sum to zero (up to {1e3 * residual:.3f} mA); "
                        f"the rest flows to {where}")
        if sc.reference is None:
            checks.append(_check("Kirchhoff residual without reference", 1e3 * residual, 1e3 * sc.dac.lsb_a,
                                 "mA", False))
    erows = _electrode_rows(sc, i)
    dens = max(r["peak_density_ma_cm2"] for r in erows)
    checks.append(_check("current density", dens, lim.max_current_density_ma_cm2, "mA/cm^2",
                         dens <= lim.max_current_density_ma_cm2 + 1e-9))
    return {"protocol": p.name, "ok": all(c["ok"] for c in checks), "checks": checks, "warnings": warnings,
            "channels": rows, "electrodes": erows}


def _electrode_rows(sc: Scenario, i_ch: np.ndarray) -> list[dict]:
    n = len(sc.electrodes)
    ie = np.zeros((i_ch.shape[0], n))
    ie[:, np.asarray(sc.channel_terminal)] = i_ch
    if sc.reference is not None:
        ie[:, sc.reference] = -i_ch.sum(axis=1)
    return _rows_from_pins(sc, ie)


def _rows_from_pins(sc: Scenario, ie: np.ndarray) -> list[dict]:
    rows = []
    for e, el in enumerate(sc.electrodes):
        pk = float(np.abs(ie[:, e]).max())
        rows.append({"electrode": el.name, "position": el.position, "area_cm2": el.area_cm2, "peak_ma": 1e3 * pk,
                     "peak_density_ma_cm2": 1e3 * pk / el.area_cm2, "dc_ua": 1e6 * float(ie[:, e].mean())})
    return rows


def safety_report(res: SimResult, lim: LimitsSpec | None = None, static: dict | None = None) -> dict:
    """Safety report of a simulation: same check names as :func:`check_protocol`, measured on the delivered
    waveforms, plus common-mode voltage and OCP events. Returns a dict like check_protocol's.

    What the protocol *asked* is checked too, not only what the chip delivered: a DAC that saturates at its
    full scale delivers a current inside the limits although the protocol asked for more, so the requested
    peak is held against the limit ("max channel current (requested)") and any saturated sample fails
    "DAC saturation". ``static``, the report of :func:`check_protocol` on the same protocol (as
    ``hpdl tes simulate`` passes it), is kept under ``"static"`` and a failure there fails this report.
    """
    lim = lim or LimitsSpec()
    sc = res.scenario
    ct = np.asarray(sc.channel_terminal)
    ipin = res.i_electrode_a
    rows = []
    for ch, name in enumerate(sc.channels):
        w, e = sc.waveforms[ch], ct[ch]
        q = period_charges(ipin[:, e], sc.fs_hz, w.period_s) if w.period_s else np.zeros(0)
        rows.append({"channel": name, "electrode": sc.electrodes[e].name,
                     "peak_target_ma": 1e3 * float(np.abs(res.i_target_a[:, ch]).max()),
                     "peak_delivered_ma": 1e3 * float(np.abs(ipin[:, e]).max()),
                     "rms_ma": 1e3 * float(np.sqrt(np.mean(ipin[:, e] ** 2))), "dc_ua": 1e6 * float(ipin[:, e].mean()),
                     "max_period_charge_nc": 1e9 * float(np.abs(q).max()) if q.size else None,
                     "headroom_v": sc.dac.compliance_v - float(np.abs(res.v_terminal_v[:, e]).max()),
                     "clipped_pct": 100.0 * float(res.clipped[:, ch].mean()),
                     "ocp_trips": sum(1 for ev in res.ocp_events if ev.channel == ch)})
    erows = _rows_from_pins(sc, ipin)
    checks = []
    asked = max(r["peak_target_ma"] for r in rows)
    checks.append(_check("max channel current (requested)", asked, lim.max_channel_current_ma, "mA",
                         asked <= lim.max_channel_current_ma + 1e-9))
    saturated = 100.0 * float((np.abs(res.i_target_a) > sc.dac.full_scale_a * (1 + 1e-9)).mean())
    checks.append(_check("DAC saturation", saturated, 0.0, "% samples", saturated == 0.0))
    peak = max(r["peak_delivered_ma"] for r in rows)
    checks.append(_check("max channel current", peak, lim.max_channel_current_ma, "mA",
                         peak <= lim.max_channel_current_ma * (1 + 1e-3)))
    total = 1e3 * float(np.clip(ipin[:, ct], 0, None).sum(axis=1).max())
    checks.append(_check("total current", total, lim.max_total_current_ma, "mA",
                         total <= lim.max_total_current_ma * (1 + 1e-3)))
    qmax = max([r["max_period_charge_nc"] or 0.0 for r in rows])
    checks.append(_check("charge imbalance per period", qmax, lim.max_charge_imbalance_nc, "nC",
                         qmax <= lim.max_charge_imbalance_nc))
    head = min(r["headroom_v"] for r in rows)
    checks.append(_check("compliance headroom", head, lim.min_compliance_headroom_v, "V",
                         head >= lim.min_compliance_headroom_v and not res.clipped.any()))
    dens = max(r["peak_density_ma_cm2"] for r in erows)
    checks.append(_check("current density", dens, lim.max_current_density_ma_cm2, "mA/cm^2",
                         dens <= lim.max_current_density_ma_cm2 * (1 + 1e-3)))
    cm = 1e3 * res.common_mode.get("max_abs_dc_v", 0.0)
    checks.append(_check("common-mode voltage |DC|", cm, lim.max_common_mode_mv, "mV", cm <= lim.max_common_mode_mv))
    checks.append(_check("OCP trips", len(res.ocp_events), 0, "count", not res.ocp_events))
    ok = all(c["ok"] for c in checks) and (static is None or bool(static["ok"]))
    extra = {} if static is None else {"static": static}
    return {"ok": ok, "checks": checks, **extra, "channels": rows, "electrodes": erows,
            "ocp_events": [{"channel": sc.channels[ev.channel], "t_trip_s": ev.t_trip_s,
                            "i_sensed_ma": 1e3 * ev.i_sensed_a} for ev in res.ocp_events],
            "common_mode": {(k[:-2] + "_mv" if k.endswith("_v") else k): (1e3 * v if k.endswith("_v") else v)
                            for k, v in res.common_mode.items()}}
