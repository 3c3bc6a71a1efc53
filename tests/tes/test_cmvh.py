import numpy as np
import pytest

from hpdl.tes import spec
from hpdl.tes.channel import CurrentDac, DacParams
from hpdl.tes.cmvh import CmvhParams, calibrate, common_mode
from hpdl.tes.impedance import AdcParams
from hpdl.tes.simulate import simulate


def test_calibration_shrinks_mismatch():
    rng = np.random.default_rng(5)
    dac = CurrentDac(8, DacParams(), rng)
    gain0, off0 = np.abs(dac.gain_err).max(), np.abs(dac.offset_a).max()
    cal = calibrate(dac, CmvhParams(), AdcParams(), rng)
    gain_res = (1 + dac.gain_err) * (1 + dac.gain_trim) - 1
    off_res = dac.offset_a + dac.offset_trim_a
    # what remains is common (calibration resistor tolerance) plus trim and measurement error
    assert np.ptp(gain_res) < 0.1 * np.ptp(dac.gain_err) and np.ptp(gain_res) < 2e-3
    assert np.abs(off_res).max() < 0.15e-6 < off0
    # the chip divides by the nominal resistor: a high resistor reads as high gain and is trimmed low
    assert abs(np.mean(gain_res) - (5000.0 / cal.r_cal_actual_ohm - 1)) < 3e-4
    assert gain0 > 2e-3


def test_common_mode_statistics():
    fs = 1000.0
    t = np.arange(2000) / fs
    v = np.stack([0.010 + np.sin(2 * np.pi * 10 * t), 0.010 - np.sin(2 * np.pi * 10 * t)], axis=1)
    v[:100] += 1.0  # a start-up transient in the first window
    cm = common_mode(v, fs, window_s=0.1, settle_s=0.1)
    assert cm["max_abs_dc_v"] == pytest.approx(0.010)
    assert cm["startup_max_abs_dc_v"] == pytest.approx(1.010)


@pytest.mark.parametrize("kind", ["4x1", "ti"])
def test_common_mode_held_near_zero_in_hd_tes_mode(kind):
    """Realistic mismatch (1 % gain, 2 uA offset, drawn), CMVH on: |DC common mode| <= 10 mV.
    The same chip with CMVH off runs its common mode to ~sum(offset) R_out / N: the bound comes from CMVH."""
    for seed in (0, 1):
        on = simulate(spec.hd_montage(kind, CmvhParams(), seed, 0.25))
        assert 1e3 * on.common_mode["max_abs_dc_v"] <= spec.CM_BOUND_MV
    from dataclasses import replace
    dur = 0.3 if kind == "4x1" else 0.05  # a few carrier periods after the ramp
    off = simulate(replace(spec.hd_montage(kind, CmvhParams(calibrate=False, switch=False), 0, dur), reference=None))
    # no DC path but the sources' output resistance: V_cm ~ sum(offsets) R_out / n_channels, up to the rail
    d = off.dac
    expected = abs(d.offset_a.sum()) * d.params.r_out_ohm / len(d.offset_a)
    assert off.common_mode["max_abs_dc_v"] > 0.1
    if expected < 5.0:  # stays linear
        assert off.common_mode["max_abs_dc_v"] == pytest.approx(expected, rel=0.3)
    else:  # the common mode drives the stages into compliance, which distorts the stimulation
        assert off.clipped.any()
