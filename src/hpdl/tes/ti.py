"""Temporal-interference (TI) helpers: scalar envelope, modulation along a direction, maximum modulation.

Reference: Grossman et al., "Noninvasive deep brain stimulation via temporally interfering electric fields",
Cell 169:1029 (2017), supplementary equations; the maximum-over-directions rule as implemented by SimNIBS
``simnibs/utils/TI_utils.py:get_maxTI``. All field functions are vectorised over leading axes: a field array
has shape ``(..., 3)`` (V/m or any consistent unit) and results have shape ``(...)``.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import curve_fit
from scipy.signal import hilbert


def envelope(t_s, a1, a2, f1_hz: float, f2_hz: float, phase_rad: float = 0.0) -> np.ndarray:
    """Envelope of ``a1 cos(2 pi f1 t) + a2 cos(2 pi f2 t + phase)``.

    >>> import numpy as np
    >>> envelope(np.array([0.0, 0.05]), 1.0, 0.5, 2000.0, 2010.0).round(6).tolist()  # max, then min
    [1.5, 0.5]

    ``sqrt(a1^2 + a2^2 + 2 a1 a2 cos(2 pi (f2 - f1) t + phase))``, which ranges over ``[|a1 - a2|, a1 + a2]``.
    ``t_s`` in s (any shape); ``a1, a2`` >= 0 in any unit; result has the broadcast shape, same unit.
    """
    a1 = np.asarray(a1, dtype=np.float64)
    a2 = np.asarray(a2, dtype=np.float64)
    if np.any(a1 < 0) or np.any(a2 < 0):
        raise ValueError("envelope: amplitudes a1 and a2 must be >= 0")
    dphi = 2 * np.pi * (f2_hz - f1_hz) * np.asarray(t_s, dtype=np.float64) + phase_rad
    return np.sqrt(np.maximum(a1 ** 2 + a2 ** 2 + 2 * a1 * a2 * np.cos(dphi), 0.0))


def modulation_depth(a1, a2) -> np.ndarray:
    """Peak-to-peak envelope modulation ``2 min(|a1|, |a2|)`` of two collinear sinusoids (same unit as inputs)."""
    return 2.0 * np.minimum(np.abs(np.asarray(a1, float)), np.abs(np.asarray(a2, float)))


def _check_fields(e1, e2):
    e1 = np.asarray(e1, dtype=np.float64)
    e2 = np.asarray(e2, dtype=np.float64)
    if e1.shape[-1:] != (3,) or e2.shape[-1:] != (3,):
        raise ValueError(f"fields must have shape (..., 3), got {e1.shape} and {e2.shape}")
    return np.broadcast_arrays(e1, e2)


def modulation_along(e1, e2, direction) -> np.ndarray:
    """TI modulation amplitude along ``direction``: ``| |(E1 + E2).n| - |(E1 - E2).n| |``.

    >>> float(modulation_along([1.0, 0, 0], [0.5, 0.5, 0], [1, 0, 0]))
    1.0

    Equals ``2 min(|E1.n|, |E2.n|)`` (Grossman 2017). ``direction`` (..., 3) is normalised here; a zero
    direction raises ValueError.
    """
    e1, e2 = _check_fields(e1, e2)
    n = np.asarray(direction, dtype=np.float64)
    norm = np.linalg.norm(n, axis=-1, keepdims=True)
    if np.any(norm == 0):
        raise ValueError("modulation_along: direction must be non-zero")
    n = n / norm
    return np.abs(np.abs(np.sum((e1 + e2) * n, -1)) - np.abs(np.sum((e1 - e2) * n, -1)))


def max_modulation(e1, e2) -> np.ndarray:
    """Maximum over directions of the TI modulation amplitude, per point.

    >>> import numpy as np
    >>> max_modulation(np.array([[1.0, 0, 0], [1.0, 0, 0]]), np.array([[-2.0, 0, 0], [0, 1.0, 0]])).round(4)
    array([2.    , 1.4142])

    Rule (Grossman 2017; SimNIBS ``get_maxTI``): order the pair so ``|E1| >= |E2|``; flip ``E2`` if
    ``E1.E2 < 0`` (the envelope depends on the sign only through the phase). With ``cos a = E1.E2/(|E1||E2|)``:
    ``2|E2|`` if ``|E2| <= |E1| cos a``, else ``2 |E2 x (E1 - E2)| / |E1 - E2|``. The second branch is 0/0
    when ``E1 == E2``; its limit there is ``2|E2|`` (and the first branch applies), which is returned.

    Parameters
    ----------
    e1, e2 : array (..., 3), broadcastable. Field amplitudes of the two carriers at each point.

    Returns
    -------
    array (...), float64, same unit as the fields.
    """
    e1, e2 = _check_fields(e1, e2)
    n1 = np.linalg.norm(e1, axis=-1)
    n2 = np.linalg.norm(e2, axis=-1)
    swap = n2 > n1
    a = np.where(swap[..., None], e2, e1)
    b = np.where(swap[..., None], e1, e2)
    flip = np.sum(a * b, -1) < 0
    b = np.where(flip[..., None], -b, b)
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    dot = np.sum(a * b, -1)  # = |a||b| cos(alpha) >= 0
    # |b| <= |a| cos(alpha)  <=>  |b| |b| <= dot  (for b != 0); written without division
    first = nb * nb <= dot + 1e-12 * na * na
    diff = a - b
    nd = np.linalg.norm(diff, axis=-1)
    cross = np.linalg.norm(np.cross(b, diff), axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        second = np.where(nd > 0, 2 * cross / np.where(nd > 0, nd, 1.0), 2 * nb)
    return np.where(first, 2 * nb, second)


def measure_envelope(signal, fs_hz: float, trim_s: float = 0.0) -> dict:
    """Envelope of a sampled two-tone signal by Hilbert transform: difference frequency and depth.

    Parameters
    ----------
    signal : (K,) float, any unit, sampled at ``fs_hz``.
    trim_s : float, seconds cut from both ends before statistics (edge effects of the transform).

    Returns
    -------
    dict with ``envelope`` (K,), ``env_max``, ``env_min``, ``depth`` (= max - min) and ``delta_f_hz``
    (envelope frequency: spectral peak refined by a least-squares sinusoid fit of envelope^2; 0 if flat).
    """
    x = np.asarray(signal, dtype=np.float64)
    if x.ndim != 1 or x.size < 16:
        raise ValueError(f"signal must be 1-D with >= 16 samples, got shape {x.shape}")
    env = np.abs(hilbert(x))
    k = int(round(trim_s * fs_hz))
    core = env[k: x.size - k] if x.size - 2 * k > 16 else env
    spec = np.abs(np.fft.rfft(core - core.mean()))
    freqs = np.fft.rfftfreq(core.size, 1.0 / fs_hz)
    peak = int(np.argmax(spec[1:]) + 1) if spec.size > 1 else 0
    # parabolic interpolation of the spectral peak for sub-bin accuracy
    df = freqs[1] if freqs.size > 1 else 0.0
    if 1 <= peak < spec.size - 1:
        y0, y1, y2 = np.log(spec[peak - 1: peak + 2] + 1e-300)
        den = y0 - 2 * y1 + y2
        shift = 0.5 * (y0 - y2) / den if den != 0 else 0.0
    else:
        shift = 0.0
    flat = core.max() - core.min() <= 1e-9 * max(core.max(), 1e-300)
    f0 = float((peak + shift) * df)
    if not flat and f0 > 0:
        # refine: env^2 = a^2 + b^2 + 2ab cos(2 pi dF t + p) exactly, so fit that sinusoid (least squares)
        tt = np.arange(core.size) / fs_hz
        y = core ** 2
        guess = (y.mean(), 0.5 * (y.max() - y.min()), f0, 0.0)
        try:
            popt, _ = curve_fit(lambda t, c, a, f, p: c + a * np.cos(2 * np.pi * f * t + p), tt, y, p0=guess,
                                maxfev=2000)
            if abs(popt[2] - f0) < 2 * df + 1e-12:
                f0 = abs(float(popt[2]))
        except RuntimeError:  # no convergence: keep the interpolated spectral peak
            pass
    return {"envelope": env, "env_max": float(core.max()), "env_min": float(core.min()),
            "depth": float(core.max() - core.min()), "delta_f_hz": 0.0 if flat else f0}
