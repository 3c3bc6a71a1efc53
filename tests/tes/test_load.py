import numpy as np
import pytest

from hpdl.tes.load import Drift, Electrode, Tissue, randles_impedance
from hpdl.tes.network import Network


def test_randles_limits_and_corner():
    assert randles_impedance(0.0, 100, 900, 1e-6) == pytest.approx(1000)
    assert abs(randles_impedance(1e9, 100, 900, 1e-6)) == pytest.approx(100, rel=1e-4)
    fc = 1 / (2 * np.pi * 900 * 1e-6)
    z = randles_impedance(fc, 0, 900, 1e-6)
    assert np.angle(z, deg=True) == pytest.approx(-45)


def test_drift_factor_and_electrode_at():
    d = Drift(final_ratio=0.5, tau_s=2.0)
    assert d.factor(0) == 1.0 and d.factor(1e6) == pytest.approx(0.5)
    e = Electrode("x", 1000, 4000, 1e-6, drift=d)
    e2 = e.at(2.0)
    k = 0.5 + 0.5 * np.exp(-1)
    assert e2.r_s_ohm == pytest.approx(1000 * k) and e2.r_ct_ohm == pytest.approx(4000 * k)
    assert e2.c_dl_f == e.c_dl_f


def test_electrode_validation():
    with pytest.raises(ValueError, match="r_s_ohm"):
        Electrode("bad", r_s_ohm=0)
    with pytest.raises(ValueError, match="area_cm2"):
        Electrode("bad", area_cm2=0)


def test_tissue_edges_must_connect():
    names = ["a", "b", "c"]
    lap, _ = Tissue("edges", edges=(("a", "b", 100.0), ("b", "c", 200.0))).laplacian(names)
    assert np.allclose(lap.sum(axis=1), 0)
    with pytest.raises(ValueError, match="separate parts"):
        Tissue("edges", edges=(("a", "b", 100.0),)).laplacian(names)
    with pytest.raises(ValueError, match="unknown electrode 'z'"):
        Tissue("edges", edges=(("a", "z", 100.0),)).laplacian(names)


def test_network_dc_divider_and_ac_oracle():
    """Resistive pair: pin voltage = I (R_a + R_b + 2 R_spread) || R_out; AC equals the time-domain matrix."""
    els = [Electrode("a", 1000, 0, 0), Electrode("b", 500, 0, 0)]
    net = Network(els, Tissue(r_spread_ohm=100), [0])
    g = np.array([1e-12, 1.0])  # b grounded through 1 Ohm
    m = net.state_space(0.0, g, np.zeros(2), 1e-5)
    expected = (1000 + 500 + 200 + 1.0) / (1 + 1e-12 * 1701)
    assert m.Z[0, 0] == pytest.approx(expected, rel=1e-9)
    v, j = net.ac(100.0, np.array([1.0 + 0j]), g)
    assert v[0].real == pytest.approx(m.Z[0, 0], rel=1e-9)
    # floating body: all electrode currents sum to zero
    assert abs(j.sum()) < 1e-12


def test_network_needs_a_ground_path():
    net = Network([Electrode("a"), Electrode("b")], Tissue(), [0])
    with pytest.raises(ValueError, match="path to chip ground"):
        net.state_space(0.0, np.zeros(2), np.zeros(2), 1e-5)
