import numpy as np
import pytest

from hpdl.tes import ti


def test_envelope_range_and_depth():
    t = np.linspace(0, 0.2, 20001)
    env = ti.envelope(t, 1.0, 0.6, 2000, 2010)
    assert env.max() == pytest.approx(1.6, rel=1e-6) and env.min() == pytest.approx(0.4, rel=1e-4)
    assert ti.modulation_depth(1.0, 0.6) == pytest.approx(1.2)
    with pytest.raises(ValueError, match=">= 0"):
        ti.envelope(t, -1.0, 1.0, 1, 2)


@pytest.mark.parametrize("e2,max_expected,along_x", [
    ((1, 0, 0), 2.0, 2.0),           # parallel, equal
    ((-2, 0, 0), 2.0, 2.0),          # anti-parallel
    ((0, -1000, 0), 2.0, 0.0),       # orthogonal, very unequal
    ((0, 0, 3000), 2.0, 0.0),        # orthogonal, very unequal
])
def test_simnibs_reference_vectors(e2, max_expected, along_x):
    e1 = np.array([1.0, 0, 0])
    assert ti.max_modulation(e1, np.array(e2, float)) == pytest.approx(max_expected, rel=1e-5)
    assert ti.modulation_along(e1, np.array(e2, float), [1, 0, 0]) == pytest.approx(along_x, abs=1e-9)


def test_degenerate_equal_fields_and_orthogonal_equal():
    e = np.array([0.3, -0.4, 1.2])
    assert ti.max_modulation(e, e) == pytest.approx(2 * np.linalg.norm(e))
    assert np.isfinite(ti.max_modulation(np.zeros(3), np.zeros(3)))
    assert ti.max_modulation(np.zeros(3), np.zeros(3)) == 0.0
    # orthogonal equal magnitudes: 2|E2 x (E1-E2)|/|E1-E2| = 2/sqrt(2)
    assert ti.max_modulation([1.0, 0, 0], [0, 1.0, 0]) == pytest.approx(np.sqrt(2))


def test_modulation_along_identity():
    rng = np.random.default_rng(0)
    e1, e2, n = rng.normal(size=(3, 500, 3))
    n /= np.linalg.norm(n, axis=-1, keepdims=True)
    expected = 2 * np.minimum(np.abs(np.sum(e1 * n, -1)), np.abs(np.sum(e2 * n, -1)))
    assert np.allclose(ti.modulation_along(e1, e2, n), expected)
    with pytest.raises(ValueError, match="non-zero"):
        ti.modulation_along(e1[0], e2[0], [0, 0, 0])


def test_max_modulation_matches_brute_force_over_directions():
    """Vectorised closed form vs the maximum over 40k directions on the sphere, for 200 random pairs."""
    rng = np.random.default_rng(1)
    e1 = rng.normal(size=(200, 3))
    e2 = rng.normal(size=(200, 3)) * rng.uniform(0.1, 3, (200, 1))
    d = rng.normal(size=(40000, 3))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    a, b = e1 @ d.T, e2 @ d.T
    brute = (2 * np.minimum(np.abs(a), np.abs(b))).max(axis=1)
    closed = ti.max_modulation(e1, e2)
    assert closed.shape == (200,)
    assert np.all(closed >= brute - 1e-9)
    assert np.allclose(closed, brute, rtol=0.02)


def test_max_modulation_bad_shape():
    with pytest.raises(ValueError, match=r"\(\.\.\., 3\)"):
        ti.max_modulation(np.ones(2), np.ones(2))


def test_measure_envelope_recovers_df_and_depth():
    fs = 100e3
    t = np.arange(int(0.5 * fs)) / fs
    s = 1.0 * np.cos(2 * np.pi * 2000 * t) + 0.5 * np.cos(2 * np.pi * 2007.5 * t)
    m = ti.measure_envelope(s, fs, trim_s=0.02)
    assert m["delta_f_hz"] == pytest.approx(7.5, abs=1e-3)
    assert m["depth"] == pytest.approx(1.0, rel=0.01)
    flat = ti.measure_envelope(np.cos(2 * np.pi * 2000 * t), fs, trim_s=0.02)
    assert flat["delta_f_hz"] == 0.0 or flat["depth"] < 1e-3
