import numpy as np
import pytest

from hpdl.tes import spec
from hpdl.tes.ocp import Ocp, OcpParams


def test_trip_after_n_consecutive_ticks_and_latch():
    p = OcpParams(offset_sigma_a=0.0, tau_sample_s=1e-12)  # ideal sampler
    ocp = Ocp(2, p, np.random.default_rng(0))
    dt = 0.1e-6
    tripped_at = None
    for k in range(100):
        i = np.array([5e-3 if k >= 10 else 1e-3, 1e-3])
        if ocp.step(k * dt, dt, i).any():
            tripped_at = k * dt
            break
    assert ocp.latched.tolist() == [True, False]
    ev = ocp.events[0]
    # over threshold from 1.0 us; ticks every 0.5 us: 1.0 us (count 1), 1.5 us (count 2 -> trip)
    assert ev.channel == 0 and ev.t_trip_s == pytest.approx(1.5e-6)
    assert tripped_at == pytest.approx(1.5e-6)
    ocp.reset(0)
    assert not ocp.latched[0]


def test_glitch_shorter_than_filter_does_not_trip():
    p = OcpParams(offset_sigma_a=0.0, tau_sample_s=1e-12, n_consecutive=3)
    ocp = Ocp(1, p, np.random.default_rng(0))
    dt = 0.5e-6  # one tick per step
    for k in range(40):
        i = np.array([5e-3 if k in (5, 6, 20) else 0.0])
        ocp.step(k * dt, dt, i)
    assert not ocp.events


def test_coarse_steps_match_fine_steps():
    """Many ticks per simulator step (vectorised) give the same trip time as one tick per step."""
    times = []
    for dt in (0.5e-6, 20e-6):
        ocp = Ocp(1, OcpParams(offset_sigma_a=0.0), np.random.default_rng(0))
        k = 0
        while not ocp.events:
            t = k * dt
            ocp.step(t, dt, np.array([4e-3 if t >= 40e-6 - 1e-12 else 0.0]))
            k += 1
        times.append(ocp.events[0].t_trip_s)
    assert times[0] == pytest.approx(times[1])


def test_short_circuit_trips_within_response_time_and_full_scale_does_not():
    rows = spec.check_ocp()
    assert rows[0].ok, rows[0].modelled
    assert rows[1].ok, rows[1].modelled


def test_params_validation():
    with pytest.raises(ValueError, match="threshold_a"):
        OcpParams(threshold_a=0)
