"""Analyses of a recorded simulation: impedance log (I/Q against the AC oracle), common mode, and TI (envelope
of each pair's delivered currents and, when the protocol gives field vectors per pair at named points, e.g.
from a leadfield, the TI modulation there)."""

from __future__ import annotations

import numpy as np

from hpdl.tes import impedance as im
from hpdl.tes.cmvh import common_mode
from hpdl.tes.network import Network
from hpdl.tes.scenario import SimResult, ground_paths
from hpdl.tes.ti import max_modulation, measure_envelope, modulation_along
from hpdl.tes.waveforms import Sine


def _pair_current(res, chs) -> np.ndarray:
    sc = res.scenario
    a, b = (sc.channel_terminal[x] for x in chs)
    return 0.5 * (res.i_electrode_a[:, a] - res.i_electrode_a[:, b])


def pair_amplitudes(res, pair, t_chip: np.ndarray) -> tuple[float, float]:
    """Delivered amplitudes (A) of a TI pair's two carriers, by I/Q demodulation over the longest stretch of
    whole common periods of f1 and f2 inside the plateau (ramps excluded; the whole record when the plateau
    is shorter than one common period)."""
    sc = res.scenario
    ramp_up = max(sc.waveforms[c].ramp_up_s for c in (*pair.channels_1, *pair.channels_2))
    ramp_dn = max(sc.waveforms[c].ramp_down_s for c in (*pair.channels_1, *pair.channels_2))
    k0 = int(np.ceil(ramp_up * sc.fs_hz))
    k1 = res.t_s.size - int(np.ceil(ramp_dn * sc.fs_hz))
    period = im.window_samples(pair.f1_hz, sc.fs_hz, 1e-9, (pair.f2_hz,))
    if k1 - k0 < period:  # plateau shorter than a common period: use the whole record (ramps bias it low)
        k0, k1 = 0, res.t_s.size
    n = max(1, (k1 - k0) // period) * period
    sl = slice(k0, min(k0 + n, res.t_s.size))
    amps = []
    for chs, f in ((pair.channels_1, pair.f1_hz), (pair.channels_2, pair.f2_hz)):
        ph = 2 * np.pi * f * t_chip[sl, chs[0]]
        amps.append(abs(im.demodulate(_pair_current(res, chs)[sl], ph)))
    return amps[0], amps[1]


def analyse_ti(res, t_chip: np.ndarray) -> list[dict]:
    """Per TI pair: envelope difference frequency and depth of the summed pair currents (Hilbert; expected
    values from the clocks and set amplitudes), delivered carrier amplitudes, and for each field point the
    maximum modulation over directions and, if a direction is given, the modulation along it (V/m).

    Pair current = (i_source_pin - i_sink_pin) / 2, in A. Field vectors are V/m per A of pair current.
    """
    sc = res.scenario
    out = []
    chips = sc.channel_chip or [0] * len(sc.channels)
    ramp = max([max(w.ramp_up_s, w.ramp_down_s) for w in sc.waveforms] + [0.0])
    for p in sc.ti_pairs:
        s = _pair_current(res, p.channels_1) + _pair_current(res, p.channels_2)
        k0 = int(round(ramp * sc.fs_hz))
        core = s[k0: s.size - k0] if s.size - 2 * k0 > 64 else s
        env = measure_envelope(core, sc.fs_hz, trim_s=min(0.1 * core.size / sc.fs_hz, 0.02))
        f1 = p.f1_hz * (1 + sc.clocks[chips[p.channels_1[0]]].ppm * 1e-6)
        f2 = p.f2_hz * (1 + sc.clocks[chips[p.channels_2[0]]].ppm * 1e-6)
        a1, a2 = pair_amplitudes(res, p, t_chip)
        points = []
        for name, e1, e2, direction in p.fields:
            e1a, e2a = np.asarray(e1) * a1, np.asarray(e2) * a2
            row = {"point": name, "ti_max_v_per_m": float(max_modulation(e1a, e2a)),
                   "e1_v_per_m": float(np.linalg.norm(e1a)), "e2_v_per_m": float(np.linalg.norm(e2a))}
            if direction is not None:
                row["ti_along_v_per_m"] = float(modulation_along(e1a, e2a, direction))
            points.append(row)
        out.append({"name": p.name, "f1_hz": p.f1_hz, "f2_hz": p.f2_hz,
                    "delta_f_expected_hz": abs(f2 - f1), "delta_f_measured_hz": env["delta_f_hz"],
                    "depth_expected_a": float(2 * min(p.amplitude1_a, p.amplitude2_a)),
                    "depth_measured_a": env["depth"], "env_max_a": env["env_max"], "env_min_a": env["env_min"],
                    "amplitude1_a": a1, "amplitude2_a": a2, "fields": points})
    return out


def common_mode_summary(res: SimResult) -> dict:
    """Common-mode statistics of a run (see :func:`hpdl.tes.cmvh.common_mode`), windows of whole common
    carrier periods, settling = longest ramp-up + one window."""
    sc = res.scenario
    freqs = sorted({f for w in sc.waveforms for f in w.carriers_hz})
    # whole common periods of all carriers (e.g. 0.1 s for 2000/2010 Hz), so AC common mode averages out
    win = im.window_samples(freqs[0], sc.fs_hz, 0.05, tuple(freqs[1:])) / sc.fs_hz if freqs else 0.05
    settle = max([w.ramp_up_s for w in sc.waveforms] + [0.0]) + win
    cm = common_mode(res.v_terminal_v, sc.fs_hz, win, settle_s=settle)
    return {k: v for k, v in cm.items() if k not in ("v_cm", "dc_windows")} | {"window_s": win, "settle_s": settle}


def measure_impedances(res: SimResult, net: Network, t_chip: np.ndarray, rng: np.random.Generator) -> list[dict]:
    """Impedance log: I/Q demodulation per sinusoidal channel over consecutive whole-period windows.

    The measured voltage is pin minus reference pin (chip ground without a reference); the current is the
    commanded one (codes x LSB). Each row also carries the AC oracle ``z_true`` of the modelled circuit at
    the window's middle (drift included) and the relative magnitude error, so the log checks itself.

    Returns a list of dicts: t_s, electrode, channel, freq_hz, z_abs_ohm, phase_deg, z_true_abs_ohm,
    z_true_phase_deg, error_pct, pga_gain, clipped (the compliance flag was up in the window: the commanded
    current was not delivered, so the value is invalid, as the chip would know).
    """
    sc = res.scenario
    rows: list[dict] = []
    all_freqs = tuple(sorted({f for w in sc.waveforms for f in w.carriers_hz}))
    ref = sc.reference
    i_cmd = res.codes * sc.dac.lsb_a
    for ch, w in enumerate(sc.waveforms):
        if not isinstance(w, Sine) or w.amplitude_a == 0:
            continue
        e = sc.channel_terminal[ch]
        v_diff = res.v_terminal_v[:, e] - (res.v_terminal_v[:, ref] if ref is not None else 0.0)
        nwin = im.window_samples(w.freq_hz, sc.fs_hz, sc.im_window_s, tuple(f for f in all_freqs if f != w.freq_hz))
        phase = w.phase(t_chip[:, ch])
        for start in range(0, res.t_s.size - nwin + 1, nwin):
            sl = slice(start, start + nwin)
            if not res.enabled[sl, ch].all() or np.all(res.codes[sl, ch] == 0):
                continue
            v_adc, gain = im.adc_convert(v_diff[sl], sc.fs_hz, sc.adc, rng)
            z = im.measure(v_adc, i_cmd[sl, ch], phase[sl])
            # oracle: phasors of every channel's commanded current at this carrier, AC-solved
            pattern = np.array([im.demodulate(i_cmd[sl, k], phase[sl]) for k in range(len(sc.channels))])
            t_mid = float(res.t_s[start + nwin // 2])
            g, _ = ground_paths(sc, res.enabled[start], t_mid)
            vt, jb = net.ac(w.freq_hz, pattern, g, t_mid)
            z_true = (vt[e] - (vt[ref] if ref is not None else 0.0)) / jb[e]
            rows.append({"t_s": t_mid, "electrode": sc.electrodes[e].name, "channel": sc.channels[ch],
                         "freq_hz": w.freq_hz, "z_abs_ohm": abs(z), "phase_deg": float(np.degrees(np.angle(z))),
                         "z_true_abs_ohm": abs(z_true), "z_true_phase_deg": float(np.degrees(np.angle(z_true))),
                         "error_pct": 100.0 * (abs(z) - abs(z_true)) / abs(z_true), "pga_gain": gain,
                         "clipped": bool(res.clipped[sl, ch].any())})
    return rows
