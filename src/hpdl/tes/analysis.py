"""TI analysis of a simulation: envelope of each pair's delivered currents and, when the protocol gives
field vectors per pair at named points (e.g. from a leadfield), the TI modulation there."""

from __future__ import annotations

import numpy as np

from hpdl.tes import impedance as im
from hpdl.tes.ti import max_modulation, measure_envelope, modulation_along


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
