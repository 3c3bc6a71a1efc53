import numpy as np
import pytest

from hpdl.tes.channel import ChipClock, CurrentDac, DacParams, quantize


def test_quantize_resolution_is_10ua_over_whole_range():
    p = DacParams()
    codes = np.arange(-250, 251)
    # every multiple of 10 uA is reproduced exactly
    assert np.array_equal(quantize(codes * 10e-6, p), codes)
    # any request in range lands within half a step
    x = np.random.default_rng(0).uniform(-2.5e-3, 2.5e-3, 10000)
    err = np.abs(quantize(x, p) * p.lsb_a - x)
    assert err.max() <= 5e-6 + 1e-12
    assert quantize(np.array([2.6e-3, -9e-3]), p).tolist() == [250, -250]


def test_quantize_is_odd_symmetric():
    p = DacParams()
    x = np.linspace(-2.5e-3, 2.5e-3, 1001) + 5e-6  # includes exact half steps
    assert np.array_equal(quantize(-x, p), -quantize(x, p))


def test_ideal_dac_outputs_code_times_lsb():
    p = DacParams.ideal()
    dac = CurrentDac(3, p, np.random.default_rng(1))
    codes = np.array([[250, -250, 1], [0, 7, -1]])
    assert np.allclose(dac.output(codes), codes * 10e-6, rtol=0, atol=1e-18)


def test_mismatch_and_trims():
    p = DacParams(noise_rms_a=0.0, inl_sigma_lsb=0.0)
    dac = CurrentDac(4, p, np.random.default_rng(2))
    assert np.all(dac.gain_err != 0) and np.all(dac.offset_a != 0)
    dac.set_trims(1 / (1 + dac.gain_err) - 1, -dac.offset_a)
    out = dac.output(np.full((1, 4), 100))[0]
    # trims are quantised: residual within half a trim step of gain and offset
    assert np.all(np.abs(out - 1e-3) <= 1e-3 * p.gain_trim_step + p.offset_trim_step_a)
    with pytest.raises(ValueError, match="codes must lie"):
        dac.output(np.full((1, 4), 251))
    with pytest.raises(ValueError, match=r"shape \(n_samples, 4\)"):
        dac.output(np.zeros((2, 3), dtype=int))


@pytest.mark.parametrize("field,value", [("lsb_a", 0.0), ("compliance_v", -1.0), ("gain_sigma", -0.1)])
def test_dac_params_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        DacParams(**{field: value})


def test_chip_clock():
    t = np.array([0.0, 1.0])
    assert np.allclose(ChipClock().chip_time(t), t)
    assert np.allclose(ChipClock(ppm=100, phase_s=1e-3).chip_time(t), [1e-3, 1.0001 + 1e-3])
