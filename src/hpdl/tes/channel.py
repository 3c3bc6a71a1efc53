"""Stimulation channel: a signed current DAC with mismatch and trims, its output stage, and chip clocks.

The abstract (seed 3) fixes only the range (-2.5..+2.5 mA), the step (10 uA) and the compliance (+-13 V).
Everything else here (mismatch spreads, INL, output resistance, trim resolutions) is an *assumption* with
a documented default; see docs/tes.md, section "Assumptions".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DacParams:
    """Parameters of one channel's current DAC and output stage (SI units).

    Parameters
    ----------
    lsb_a : float
        Code step in A (spec: 10 uA).
    full_scale_a : float
        Largest magnitude in A (spec: 2.5 mA); codes run over ``-full_scale/lsb .. +full_scale/lsb``.
    gain_sigma : float
        Standard deviation of the per-channel gain error (relative), before calibration. Assumption: 1 %.
    offset_sigma_a : float
        Standard deviation of the per-channel output offset current in A, before calibration. Assumption: 2 uA.
    inl_sigma_lsb : float
        Standard deviation of the static per-code error (integral non-linearity), in LSB. Assumption: 0.02.
    noise_rms_a : float
        White output-current noise per sample in A rms. Assumption: 20 nA.
    compliance_v : float
        Output compliance: the terminal voltage is held within +-compliance_v (spec: 13 V).
    r_out_ohm : float
        Output resistance of the current source to chip ground. Assumption: 50 MOhm.
    gain_trim_step : float
        Relative resolution of the analog gain-trim DAC. Assumption: 2**-11 (0.05 %).
    offset_trim_step_a : float
        Resolution of the offset-trim current DAC in A. Assumption: 0.1 uA.
    """

    lsb_a: float = 10e-6
    full_scale_a: float = 2.5e-3
    gain_sigma: float = 0.01
    offset_sigma_a: float = 2e-6
    inl_sigma_lsb: float = 0.02
    noise_rms_a: float = 20e-9
    compliance_v: float = 13.0
    r_out_ohm: float = 50e6
    gain_trim_step: float = 2.0 ** -11
    offset_trim_step_a: float = 0.1e-6

    def __post_init__(self) -> None:
        for name in ("lsb_a", "full_scale_a", "compliance_v", "r_out_ohm", "gain_trim_step", "offset_trim_step_a"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DacParams.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("gain_sigma", "offset_sigma_a", "inl_sigma_lsb", "noise_rms_a"):
            if getattr(self, name) < 0:
                raise ValueError(f"DacParams.{name} must be >= 0, got {getattr(self, name)!r}")
        ratio = self.full_scale_a / self.lsb_a
        if abs(ratio - round(ratio)) > 1e-6:
            raise ValueError(f"DacParams.full_scale_a / lsb_a must be an integer, got {ratio!r}")

    @property
    def max_code(self) -> int:
        """Largest code magnitude (250 for the spec values)."""
        return int(round(self.full_scale_a / self.lsb_a))

    @classmethod
    def ideal(cls, **overrides) -> "DacParams":
        """A DAC without mismatch, INL or noise (for exact tests); ``overrides`` replace any field."""
        base = dict(gain_sigma=0.0, offset_sigma_a=0.0, inl_sigma_lsb=0.0, noise_rms_a=0.0)
        base.update(overrides)
        return cls(**base)


def quantize(current_a: np.ndarray, params: DacParams) -> np.ndarray:
    """Map requested currents to DAC codes: round half away from zero, then saturate at the full scale.

    >>> quantize(np.array([14.9e-6, -15e-6, 3e-3]), DacParams()).tolist()
    [1, -2, 250]

    Rounding half away from zero is odd-symmetric (``code(-x) == -code(x)``), so a symmetric waveform stays
    charge balanced after quantisation.

    Parameters
    ----------
    current_a : array of float, any shape, in A.
    params : DacParams

    Returns
    -------
    codes : int64 array of the same shape, in ``[-max_code, max_code]``.
    """
    x = np.asarray(current_a, dtype=np.float64) / params.lsb_a
    codes = np.sign(x) * np.floor(np.abs(x) + 0.5)
    return np.clip(codes, -params.max_code, params.max_code).astype(np.int64)


class CurrentDac:
    """Current DACs of ``n_channels`` channels with drawn mismatch and settable trims.

    The delivered source current of channel ``c`` for code ``k`` is::

        i = (1 + gain_err[c]) * (1 + gain_trim[c]) * (k * lsb + inl[c, k]) + offset[c] + offset_trim[c] + noise

    Mismatch (``gain_err``, ``offset``, ``inl``) is drawn once from ``rng``; trims start at zero and are set by
    :func:`hpdl.tes.cmvh.calibrate`.

    Parameters
    ----------
    n_channels : int, >= 1
    params : DacParams
    rng : numpy.random.Generator
        Source of the mismatch draw and of the output noise.
    """

    def __init__(self, n_channels: int, params: DacParams, rng: np.random.Generator):
        if n_channels < 1:
            raise ValueError(f"n_channels must be >= 1, got {n_channels!r}")
        self.params = params
        self.rng = rng
        self.n_channels = n_channels
        self.gain_err = params.gain_sigma * rng.standard_normal(n_channels)
        self.offset_a = params.offset_sigma_a * rng.standard_normal(n_channels)
        m = params.max_code
        inl = params.inl_sigma_lsb * params.lsb_a * rng.standard_normal((n_channels, 2 * m + 1))
        inl[:, m] = 0.0  # code 0 has no INL: the offset term carries the zero error
        self.inl_a = inl
        self.gain_trim = np.zeros(n_channels)
        self.offset_trim_a = np.zeros(n_channels)

    def set_trims(self, gain_trim: np.ndarray, offset_trim_a: np.ndarray) -> None:
        """Set the trims, rounded to the trim DACs' resolutions (``gain_trim_step``, ``offset_trim_step_a``)."""
        p = self.params
        self.gain_trim = np.round(np.asarray(gain_trim, float) / p.gain_trim_step) * p.gain_trim_step
        self.offset_trim_a = np.round(np.asarray(offset_trim_a, float) / p.offset_trim_step_a) * p.offset_trim_step_a

    def output(self, codes: np.ndarray, *, noise: bool = True) -> np.ndarray:
        """Source currents in A for codes of shape ``(n_samples, n_channels)`` (int); same shape, float64."""
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != self.n_channels:
            raise ValueError(f"codes must have shape (n_samples, {self.n_channels}), got {codes.shape}")
        p = self.params
        if np.abs(codes).max(initial=0) > p.max_code:
            raise ValueError(f"codes must lie in [-{p.max_code}, {p.max_code}]")
        ideal = codes * p.lsb_a + self.inl_a[np.arange(self.n_channels), codes + p.max_code]
        i = (1 + self.gain_err) * (1 + self.gain_trim) * ideal + self.offset_a + self.offset_trim_a
        if noise and p.noise_rms_a > 0:
            i = i + p.noise_rms_a * self.rng.standard_normal(i.shape)
        return i


@dataclass(frozen=True)
class ChipClock:
    """Timebase of one chip: ``t_chip = (1 + ppm * 1e-6) * t + phase_s``.

    A shared clock (every chip ``ppm=0, phase_s=0``) keeps the TI difference frequency exact; a skewed clock
    shifts each chip's carriers by ``ppm`` and so moves the envelope frequency.
    """

    ppm: float = 0.0
    phase_s: float = 0.0

    def chip_time(self, t: np.ndarray) -> np.ndarray:
        """Chip time in s for simulation times ``t`` in s (any shape)."""
        return (1.0 + self.ppm * 1e-6) * np.asarray(t, dtype=np.float64) + self.phase_s
