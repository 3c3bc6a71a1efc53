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

from hpdl.tes.channel import DacParams, quantize
from hpdl.tes.network import Network
from hpdl.tes.protocol import LimitsSpec, ProtocolSpec, to_scenario
from hpdl.tes.scenario import G_LEAK_S, Scenario, SimResult
from hpdl.tes.waveforms import Dc, Sine

_CHECK_CHUNK = 1 << 17  # samples per pass of check_protocol: bounded memory on any protocol length


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


class _PeriodCharges:
    """Streaming :func:`period_charges`: feed (K_i, C) current chunks in order; keeps the largest |charge| of a
    whole period per channel without holding the record (a 600 s protocol at MHz rates has 10^8+ samples)."""

    def __init__(self, periods_s: list[float | None], fs_hz: float) -> None:
        self.periods, self.fs = periods_s, fs_hz
        c = len(periods_s)
        self.q0 = np.zeros(c)               # cumulative charge (C) at the start of the next chunk
        self.n0 = 0                         # sample index at the start of the next chunk
        self.next_b = np.zeros(c, np.int64)  # next period boundary to evaluate, per channel
        self.last_qb = np.zeros(c)          # cumulative charge at the previous boundary
        self.max_abs = np.zeros(c)
        self.any = np.zeros(c, bool)

    def feed(self, i_a: np.ndarray) -> None:
        n = i_a.shape[0]
        q = self.q0 + np.concatenate([np.zeros((1, i_a.shape[1])), np.cumsum(i_a, axis=0) / self.fs])
        tq = (self.n0 + np.arange(n + 1)) / self.fs
        for ch, period in enumerate(self.periods):
            if not period:
                continue
            # boundaries b * period inside [tq[0], tq[-1]] (the 1e-9 as in period_charges)
            last = int(np.floor(tq[-1] / period + 1e-9))
            b = np.arange(self.next_b[ch], last + 1)
            if b.size == 0:
                continue
            qb = np.interp(b * period, tq, q[:, ch])
            if self.next_b[ch] == 0:
                self.last_qb[ch] = qb[0]
                qb, b = qb[1:], b[1:]
            if qb.size:
                d = np.diff(np.concatenate([[self.last_qb[ch]], qb]))
                self.max_abs[ch] = max(self.max_abs[ch], float(np.abs(d).max()))
                self.any[ch] = True
                self.last_qb[ch] = qb[-1]
            self.next_b[ch] = last + 1
        self.q0 = q[-1]
        self.n0 += n


def check_protocol(p: ProtocolSpec) -> dict:
    """Static safety check of a validated protocol (waveforms on the DAC grid, ideal DAC, nominal load).

    Every sample of the whole protocol is checked, streamed in chunks of ``_CHECK_CHUNK`` samples so memory
    stays bounded; a check never covers only part of a protocol. (How long a protocol can be is bounded
    where it is parsed: ``duration_s`` x the sample rate must fit the simulator's record, see
    :meth:`hpdl.tes.simulate.Scenario.validate`.)

    Returns a dict: ``ok``, ``checks`` (list of check dicts), ``warnings`` (list of str; an amplitude off the
    DAC's 10 uA step is named with the field and the current the chip will deliver instead), ``samples_checked``
    and ``samples_total`` (equal), ``duration_s`` and ``sample_rate_hz`` (Hz) of the checked grid, ``channels``
    and ``electrodes`` (lists of row dicts).
    """
    sc = to_scenario(p)
    lim: LimitsSpec = p.limits
    k_total = int(round(sc.duration_s * sc.fs_hz))
    chips = sc.channel_chip or [0] * len(sc.channels)
    c, n_el = len(sc.channels), len(sc.electrodes)
    term = np.asarray(sc.channel_terminal)
    peak_req, peak_dac, sum_i = np.zeros(c), np.zeros(c), np.zeros(c)
    total_max, residual = 0.0, 0.0
    el_peak, el_sum = np.zeros(n_el), np.zeros(n_el)
    charges = _PeriodCharges([w.period_s for w in sc.waveforms], sc.fs_hz)
    done = 0
    for start in range(0, k_total, _CHECK_CHUNK):
        t = np.arange(start, min(start + _CHECK_CHUNK, k_total)) / sc.fs_hz
        target = np.stack([w(sc.clocks[chips[ch]].chip_time(t), sc.duration_s)
                           for ch, w in enumerate(sc.waveforms)], 1)
        i = quantize(target, sc.dac) * sc.dac.lsb_a
        peak_req = np.maximum(peak_req, np.abs(target).max(axis=0))
        # a sine peaks between grid points (up to 1 - cos(pi f / fs) lower on the grid): hold the requested
        # peak as its envelope, |offset| + |amplitude| times the on/off ramp
        for ch, w in enumerate(sc.waveforms):
            if isinstance(w, Sine):
                env = Dc(amplitude_a=w.peak_a, ramp_up_s=w.ramp_up_s, ramp_down_s=w.ramp_down_s)
                tc = sc.clocks[chips[ch]].chip_time(t)
                peak_req[ch] = max(peak_req[ch], float(env(tc, sc.duration_s).max()))
        peak_dac = np.maximum(peak_dac, np.abs(i).max(axis=0))
        sum_i += i.sum(axis=0)
        total_max = max(total_max, float(np.clip(target, 0, None).sum(axis=1).max()))
        net = i.sum(axis=1)
        residual = max(residual, float(np.abs(net).max()))
        ie = np.zeros((t.size, n_el))
        ie[:, term] = i
        if sc.reference is not None:
            ie[:, sc.reference] = -net
        el_peak = np.maximum(el_peak, np.abs(ie).max(axis=0))
        el_sum += ie.sum(axis=0)
        charges.feed(i)
        done += t.size
    if done != k_total:  # pragma: no cover - the loop above covers every sample by construction
        raise RuntimeError(f"check_protocol covered {done} of {k_total} samples")
    warnings: list[str] = _rounding_warnings(p, sc)
    # model.dac may describe a larger chip than the specified one; a reader of the report must see that the
    # range and compliance checks below hold against the override, not the chip's specification
    spec = DacParams()
    if sc.dac.full_scale_a > spec.full_scale_a * (1 + 1e-9):
        warnings.append(f"model.dac.full_scale_a = {1e3 * sc.dac.full_scale_a:g} mA is above the specified chip's "
                        f"{1e3 * spec.full_scale_a:g} mA range; currents are checked against the override")
    if sc.dac.compliance_v > spec.compliance_v * (1 + 1e-9):
        warnings.append(f"model.dac.compliance_v = {sc.dac.compliance_v:g} V is above the specified chip's "
                        f"{spec.compliance_v:g} V; the headroom is checked against the override")
    checks: list[dict] = []
    rows = []
    vpk = predicted_peak_voltages(sc)
    for ch, name in enumerate(sc.channels):
        e = sc.channel_terminal[ch]
        rows.append({"channel": name, "electrode": sc.electrodes[e].name, "peak_ma": 1e3 * float(peak_req[ch]),
                     "peak_after_dac_ma": 1e3 * float(peak_dac[ch]), "dc_ua": 1e6 * float(sum_i[ch] / k_total),
                     "max_period_charge_nc": 1e9 * float(charges.max_abs[ch]) if charges.any[ch] else None,
                     "predicted_peak_v": float(vpk[e]), "headroom_v": sc.dac.compliance_v - float(vpk[e])})
        if peak_req[ch] > sc.dac.full_scale_a * (1 + 1e-9):
            warnings.append(f"channel {name}: {1e3 * peak_req[ch]:.3f} mA exceeds the DAC range and would saturate")
    peak_ch = max(r["peak_ma"] for r in rows)
    # the chip's own range is a hard limit that a protocol's `limits` cannot raise
    full_ma = 1e3 * sc.dac.full_scale_a
    checks.append(_check("requested current within the chip's DAC range", peak_ch, full_ma, "mA",
                         peak_ch <= full_ma * (1 + 1e-9)))
    checks.append(_check("max channel current", peak_ch, lim.max_channel_current_ma, "mA",
                         peak_ch <= lim.max_channel_current_ma + 1e-9))
    total = total_max * 1e3  # as requested, like the channel peaks
    checks.append(_check("total current", total, lim.max_total_current_ma, "mA",
                         total <= lim.max_total_current_ma + 1e-9))
    qmax = max([r["max_period_charge_nc"] or 0.0 for r in rows])
    checks.append(_check("charge imbalance per period", qmax, lim.max_charge_imbalance_nc, "nC",
                         qmax <= lim.max_charge_imbalance_nc))
    headroom = min(r["headroom_v"] for r in rows)
    checks.append(_check("compliance headroom (predicted)", headroom, lim.min_compliance_headroom_v, "V",
                         headroom >= lim.min_compliance_headroom_v))
    if residual > 0.5 * sc.dac.lsb_a:
        where = f"the reference {sc.electrodes[sc.reference].name}" if sc.reference is not None else "nowhere"
        warnings.append(f"channel currents do not sum to zero (up to {1e3 * residual:.3f} mA); "
                        f"the rest flows to {where}")
        if sc.reference is None:
            checks.append(_check("Kirchhoff residual without reference", 1e3 * residual, 1e3 * sc.dac.lsb_a,
                                 "mA", False))
    # a driven electrode carries its channel's requested peak, which may fall between grid points (see above)
    el_peak[term] = np.maximum(el_peak[term], peak_req)
    erows = [{"electrode": el.name, "position": el.position, "area_cm2": el.area_cm2,
              "peak_ma": 1e3 * float(el_peak[e]), "peak_density_ma_cm2": 1e3 * float(el_peak[e]) / el.area_cm2,
              "dc_ua": 1e6 * float(el_sum[e] / k_total)} for e, el in enumerate(sc.electrodes)]
    dens = max(r["peak_density_ma_cm2"] for r in erows)
    checks.append(_check("current density", dens, lim.max_current_density_ma_cm2, "mA/cm^2",
                         dens <= lim.max_current_density_ma_cm2 + 1e-9))
    return {"protocol": p.name, "ok": all(c["ok"] for c in checks), "checks": checks, "warnings": warnings,
            "samples_checked": done, "samples_total": k_total, "duration_s": sc.duration_s, "sample_rate_hz": sc.fs_hz,
            "channels": rows, "electrodes": erows}


def _rounding_warnings(p: ProtocolSpec, sc: Scenario) -> list[str]:
    """One warning per current value of the protocol that is not a whole number of DAC steps (10 uA by
    default), naming the field, the value asked and the value the chip delivers (nearest code). Values between
    a ramp's end points are interpolated by design and not reported."""
    lsb_ma = 1e3 * sc.dac.lsb_a
    out = []

    def off_step(value_ma: float) -> bool:
        steps = value_ma / lsb_ma
        return abs(steps - round(steps)) > 1e-6

    def look(field: str, value_ma: float, more: str = "") -> None:
        if off_step(value_ma):
            got = float(quantize(np.array([value_ma * 1e-3]), sc.dac)[0]) * lsb_ma
            out.append(f"{field}: {value_ma:g} mA is not a multiple of the DAC step ({1e3 * lsb_ma:g} uA); "
                       f"the chip delivers {got:g} mA (rounded to the nearest code){more}")

    for name, w in p.waveforms.items():
        keys = {"dc": ("amplitude_ma",), "sine": ("amplitude_ma", "offset_ma"), "ramp": ("start_ma", "end_ma"),
                "arbitrary": ()}[w.type]
        for key in keys:
            look(f"waveforms.{name}.{key}", getattr(w, key))
        if w.type == "arbitrary":  # one warning per waveform, not per sample
            off = [j for j, x in enumerate(w.samples_ma) if off_step(x)]
            if off:
                look(f"waveforms.{name}.samples_ma.{off[0]}", w.samples_ma[off[0]],
                     f"; {len(off)} of {len(w.samples_ma)} samples are off the step" if len(off) > 1 else "")
    for j, t in enumerate(p.ti_pairs):
        for key in ("amplitude1_ma", "amplitude2_ma"):
            look(f"ti_pairs.{j}.{key}", getattr(t, key))
    return out


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
