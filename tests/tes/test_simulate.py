import math

import numpy as np
import pytest

from hpdl.tes import spec
from hpdl.tes.channel import DacParams
from hpdl.tes.cmvh import CmvhParams
from hpdl.tes.load import Electrode
from hpdl.tes.safety import period_charges
from hpdl.tes.simulate import Scenario, simulate
from hpdl.tes.waveforms import Arbitrary, Dc, Sine

R500K = Electrode("R500k", 500e3, 0.0, 0.0)


@pytest.mark.parametrize("amp", [2.5e-3, -2.5e-3])
def test_compliance_clip_at_13v(amp):
    """Spec: a 2.5 mA request into 500 kOhm delivers no more than 26 uA and is flagged."""
    res = simulate(spec.bench(R500K, Dc(amplitude_a=amp), 1e-3, 100e3))
    i = res.i_electrode_a[:, 0]
    assert np.abs(i).max() <= 26e-6
    assert np.abs(i).min() > 25e-6 and np.sign(i).min() == np.sign(amp) == np.sign(i).max()
    assert np.abs(res.v_terminal_v[:, 0]).max() == pytest.approx(13.0, abs=1e-9)
    assert res.clipped[:, 0].all()


def test_no_clip_within_compliance_and_full_range():
    res = simulate(spec.bench(Electrode("R1k", 998.0, 0, 0), Dc(amplitude_a=-2.5e-3), 1e-3, 100e3,
                              dac=DacParams.ideal(), cmvh=CmvhParams(calibrate=False)))
    assert not res.clipped.any()
    # ideal DAC: only the 50 MOhm output resistance shunts (1.1 kOhm incl. switch vs 50 MOhm)
    assert res.i_electrode_a[:, 0].mean() == pytest.approx(-2.5e-3, rel=1e-4)


def test_kirchhoff_currents_sum_to_zero_in_a_montage():
    res = simulate(spec.hd_montage("ti", CmvhParams(), 0, 0.02))
    # floating body: the currents into all electrodes (reference included) cancel
    assert np.abs(res.i_electrode_a.sum(axis=1)).max() < 1e-12
    # the sources' output resistance carries the rest: pins vs sources differ by V / R_out only
    ct = res.scenario.channel_terminal
    leak = res.v_terminal_v[:, ct] / res.scenario.dac.r_out_ohm
    assert np.allclose(res.i_electrode_a[:, ct], res.i_source_a - leak, atol=1e-12)


def test_symmetric_waveforms_are_charge_balanced():
    fs = 100e3
    load = Electrode("R1k", 1000.0, 0, 0)
    ideal = dict(dac=DacParams.ideal(), cmvh=CmvhParams(calibrate=False))
    sine = simulate(spec.bench(load, Sine(amplitude_a=1.234e-3, freq_hz=1000.0), 0.02, fs, **ideal))
    q = period_charges(sine.i_electrode_a[:, 0], fs, 1e-3)
    assert q.size == 20 and np.abs(q).max() < 1e-15  # vs 0.39 uC per phase
    pulse = Arbitrary(samples_a=(1e-3, 1e-3, 0, -1e-3, -1e-3, 0), sample_rate_hz=10e3)
    bi = simulate(spec.bench(load, pulse, 0.012, fs, **ideal))
    assert np.abs(period_charges(bi.i_electrode_a[:, 0], fs, 6e-4)).max() < 1e-15
    # an offset is caught: 10 uA DC is 10 nC per 1 ms period
    off = simulate(spec.bench(load, Sine(amplitude_a=1e-3, freq_hz=1000.0, offset_a=10e-6), 0.01, fs, **ideal))
    assert period_charges(off.i_electrode_a[:, 0], fs, 1e-3) == pytest.approx(np.full(10, 10e-9), rel=1e-3)


def test_time_domain_matches_ac_oracle_on_randles_load():
    load = Electrode("randles", 1000.0, 9000.0, 1e-7)
    res = simulate(spec.bench(load, Sine(amplitude_a=0.5e-3, freq_hz=1000.0), 0.2, 100e3))
    rows = res.impedance_log
    assert len(rows) == 4
    for r in rows[1:]:  # first window holds the start-up transient
        assert abs(r["error_pct"]) < 0.5
        assert abs(r["phase_deg"] - r["z_true_phase_deg"]) < 0.2


def test_ti_envelope_from_two_chips():
    rows = spec.check_ti(duration_s=0.3)
    assert all(r.ok for r in rows), [r.modelled for r in rows]


def test_impedance_log_tracks_drift():
    from hpdl.tes import protocol

    p = protocol.load(None)
    res = simulate(protocol.to_scenario(p))
    f3 = [r for r in res.impedance_log if r["electrode"] == "F3"]
    assert f3[-1]["z_abs_ohm"] < 0.95 * f3[0]["z_abs_ohm"]  # skin impedance falls
    assert max(abs(r["error_pct"]) for r in res.impedance_log) < 5.0
    assert {"t_s", "electrode", "z_abs_ohm", "phase_deg"} <= set(f3[0])


def test_scenario_validation_names_field():
    base = dict(electrodes=[Electrode("a"), Electrode("b")], channels=["c"], channel_terminal=[0],
                waveforms=[Dc(amplitude_a=1e-3)], duration_s=0.01, fs_hz=10e3)
    with pytest.raises(ValueError, match="reference is required"):
        simulate(Scenario(**base))
    with pytest.raises(ValueError, match="must not be driven"):
        simulate(Scenario(**base, reference=0))
    with pytest.raises(ValueError, match="duration_s and fs_hz"):
        simulate(Scenario(**(base | {"duration_s": 0.0}), reference=1))
    with pytest.raises(ValueError, match="GiB"):
        simulate(Scenario(**(base | {"duration_s": 3600.0, "fs_hz": 1e6}), reference=1))
    assert math.isfinite(simulate(Scenario(**base, reference=1)).v_terminal_v.max())


def test_vectorised_chunks_equal_step_by_step(monkeypatch):
    """The modal/lfilter fast path and the per-sample path give the same waveforms."""
    import importlib

    sim = importlib.import_module("hpdl.tes.simulate")  # the package re-exports the function of that name

    sc = spec.hd_montage("4x1", CmvhParams(), 2, 0.05)
    fast = simulate(sc)
    monkeypatch.setattr(sim._Stepper, "fast_chunk", lambda self, *a: False)
    slow = simulate(sc)
    assert np.allclose(fast.v_terminal_v, slow.v_terminal_v, rtol=0, atol=1e-9)
    assert np.allclose(fast.i_electrode_a, slow.i_electrode_a, rtol=0, atol=1e-13)


def test_compliance_solve_matches_convex_problem():
    """_clip solves min 1/2 x'Zx - V_req'x + vc |x|_1; compare with a direct minimisation."""
    from scipy.optimize import minimize

    from hpdl.tes.simulate import _clip

    rng = np.random.default_rng(3)
    for trial in range(20):
        a = rng.normal(size=(5, 5)) * 1e3
        z = a @ a.T + np.eye(5) * 5e3
        i_req = rng.uniform(-2.5e-3, 2.5e-3, 5)
        rest = rng.normal(size=5) * 5
        i, held = _clip(i_req, rest, z, 13.0, np.ones(5, bool))
        v = z @ i + rest
        assert np.all(np.abs(v) <= 13.0 + 1e-9)
        assert np.allclose(np.abs(v[held]), 13.0)
        # at +13 V the stage delivers at most its request, at -13 V at least (it may clamp any excess)
        assert np.all(np.where(v[held] > 0, i[held] <= i_req[held] + 1e-15, i[held] >= i_req[held] - 1e-15))
        assert np.allclose(i[~held], i_req[~held])
        v_req = z @ i_req + rest
        f = lambda x: 0.5 * x @ z @ x - v_req @ x + 13.0 * np.abs(x).sum()  # noqa: E731
        best = minimize(f, np.zeros(5), method="Powell", options={"xtol": 1e-12, "ftol": 1e-15, "maxiter": 20000})
        assert f(i_req - i) <= best.fun + 1e-9


def test_ti_fields_at_points_use_delivered_amplitudes():
    from hpdl.tes import protocol, ti

    p = protocol.load(None)
    res = simulate(protocol.to_scenario(p))
    info = res.ti[0]
    assert info["amplitude1_a"] == pytest.approx(1e-3, rel=5e-3)
    assert info["amplitude2_a"] == pytest.approx(1e-3, rel=5e-3)
    spec_fields = p.ti_pairs[0].fields
    for row, fs in zip(info["fields"], spec_fields):
        e1 = np.array(fs.e1_v_per_m_per_ma) * 1e3 * info["amplitude1_a"]
        e2 = np.array(fs.e2_v_per_m_per_ma) * 1e3 * info["amplitude2_a"]
        assert row["point"] == fs.point
        assert row["ti_max_v_per_m"] == pytest.approx(float(ti.max_modulation(e1, e2)))
    assert info["fields"][0]["ti_along_v_per_m"] == pytest.approx(2 * min(0.12, 0.10), rel=5e-3)
