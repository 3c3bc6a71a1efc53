"""Impedance measurement during tACS: ADC front end and I/Q demodulation over whole periods.

The chip knows the current it commands (codes x LSB, trimmed by calibration). It samples the electrode's
voltage against the reference electrode with a PGA + ADC and correlates both the voltage and the commanded
current with ``cos`` and ``sin`` at the channel's own carrier (its own clock, so the reference is coherent)::

    Z = sum(v[n] exp(-j theta[n])) / sum(i_cmd[n] exp(-j theta[n]))

over an integer number of carrier periods. That rejects DC exactly; a second TI carrier is rejected exactly
when the window is also a whole number of its periods (a multiple of 1/gcd(f1, f2)), and to ~1/(N dF T)
otherwise (related practice: Khadka et al. 2015, PMC4277725; models_tes.md section 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np


@dataclass(frozen=True)
class AdcParams:
    """PGA + ADC of the impedance front end (assumptions; the abstract gives none of these).

    Parameters
    ----------
    bits : int
        Resolution over the full scale (assumption: 12).
    full_scale_v : float
        Input range +-full_scale_v at PGA gain 1 (13 V, the compliance).
    pga_gains : tuple of float
        Selectable gains; the largest one that keeps the window's peak under 90 % of full scale is used.
    noise_density_v_rthz : float
        Input-referred white noise density, V/sqrt(Hz) (assumption: 1 uV/sqrt(Hz), pessimistic).
    """

    bits: int = 12
    full_scale_v: float = 13.0
    pga_gains: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    noise_density_v_rthz: float = 1e-6

    def __post_init__(self) -> None:
        if not 4 <= self.bits <= 24:
            raise ValueError(f"AdcParams.bits must be in [4, 24], got {self.bits!r}")
        if not self.full_scale_v > 0 or self.noise_density_v_rthz < 0 or not self.pga_gains:
            raise ValueError("AdcParams: full_scale_v must be > 0, noise_density_v_rthz >= 0, pga_gains non-empty")


def adc_convert(v: np.ndarray, fs_hz: float, params: AdcParams, rng: np.random.Generator,
                gain: float | None = None) -> tuple[np.ndarray, float]:
    """Sample voltages through the PGA + ADC: add white noise, quantise, clip at full scale.

    Parameters
    ----------
    v : (K,) float, V, sampled at ``fs_hz``.
    gain : PGA gain to use; None picks the largest listed gain with ``peak * gain <= 0.9 full scale``.

    Returns
    -------
    (codes converted back to volts at the input, (K,) float64; the gain used).
    """
    v = np.asarray(v, dtype=np.float64)
    if gain is None:
        peak = float(np.max(np.abs(v))) if v.size else 0.0
        fits = [g for g in sorted(params.pga_gains) if peak * g <= 0.9 * params.full_scale_v]
        gain = fits[-1] if fits else min(params.pga_gains)
    sigma = params.noise_density_v_rthz * np.sqrt(fs_hz / 2.0)  # white noise over the Nyquist band
    x = (v + sigma * rng.standard_normal(v.shape)) * gain
    lsb = 2 * params.full_scale_v / 2 ** params.bits
    x = np.clip(np.round(x / lsb) * lsb, -params.full_scale_v, params.full_scale_v - lsb)
    return x / gain, float(gain)


def demodulate(signal: np.ndarray, phase_rad: np.ndarray) -> complex:
    """Complex amplitude of ``signal`` at the carrier whose phase at each sample is ``phase_rad``.

    >>> ph = 2 * np.pi * np.arange(100) / 100
    >>> round(abs(demodulate(3 * np.cos(ph + 0.5) + 7.0, ph)), 9)  # the DC offset is rejected
    3.0

    ``2/K sum(signal exp(-j phase))``: for ``A cos(phase + p)`` over whole periods it returns ``A exp(j p)``.
    Both arrays are (K,) float.
    """
    s = np.asarray(signal, dtype=np.float64)
    ph = np.asarray(phase_rad, dtype=np.float64)
    if s.shape != ph.shape or s.ndim != 1 or s.size == 0:
        raise ValueError(f"signal and phase_rad must be equal-length 1-D arrays, got {s.shape}, {ph.shape}")
    return complex(2.0 / s.size * np.sum(s * np.exp(-1j * ph)))


def measure(v: np.ndarray, i_cmd: np.ndarray, phase_rad: np.ndarray) -> complex:
    """Impedance in Ohm = demodulated voltage / demodulated commanded current (see module docstring).

    Raises ValueError when the current has no component at the carrier (|I| == 0).
    """
    i_ph = demodulate(i_cmd, phase_rad)
    if abs(i_ph) == 0:
        raise ValueError("measure: the commanded current has no component at the carrier frequency")
    return demodulate(v, phase_rad) / i_ph


def window_samples(freq_hz: float, fs_hz: float, min_window_s: float,
                   other_freqs_hz: tuple[float, ...] = ()) -> int:
    """Samples in one measurement window: whole periods of ``freq_hz`` (and of ``other_freqs_hz`` when they
    share a common period no longer than 4 x ``min_window_s``), at least ``min_window_s`` long.

    Frequencies are rationalised to 1 mHz. The window is rounded to whole samples, so it is exact only when
    ``fs_hz`` is a multiple of the common frequency; otherwise leakage is of order 1 / samples.
    """
    if not (freq_hz > 0 and fs_hz > 0 and min_window_s > 0):
        raise ValueError("window_samples: freq_hz, fs_hz and min_window_s must be > 0")
    base = Fraction(freq_hz).limit_denominator(1000)
    common = base
    for f in other_freqs_hz:
        g = _gcd_fraction(common, Fraction(f).limit_denominator(1000))
        if g > 0 and 1 / g <= 4 * min_window_s:
            common = g
    period = 1.0 / float(common)
    n_periods = max(1, int(np.ceil(min_window_s / period - 1e-9)))
    return int(round(n_periods * period * fs_hz))


def _gcd_fraction(a: Fraction, b: Fraction) -> Fraction:
    from math import gcd
    den = a.denominator * b.denominator // gcd(a.denominator, b.denominator)
    return Fraction(gcd(int(a * den), int(b * den)), den)
