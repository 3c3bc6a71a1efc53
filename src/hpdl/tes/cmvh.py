"""Common-mode voltage holding (CMVH): digital calibration of channel mismatch plus an analog switch.

Why it is needed: the body is floating. With every electrode driven by a current source, any net current
``sum(i)`` (from gain and offset mismatch between sourcing and sinking channels) has no return path but the
sources' output resistances, so the electrodes' common-mode voltage runs to ``sum(i) * R_out / N``, i.e. to
the compliance rail. The chip's two mechanisms, as modelled here:

1. *Digital calibration* (:func:`calibrate`): each channel drives +code, 0 and -code into an on-chip
   calibration resistor; the ADC measures the voltages; gain and offset are estimated and written to trim
   DACs. It shrinks the net DC current from ~sqrt(N) x 2 uA to ~0.1 uA.
2. *Analog switch* (``switch=True``): ties the reference electrode's pin to chip ground (0 V) through
   ``r_switch_ohm``; the residual imbalance flows there, so the common mode sits at
   ``residual x (Z_ref + R_switch)``, a few mV.

Grossman 2017 used a reference electrode carrying the imbalance of isolated balanced pairs; this is that idea.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpdl.tes.channel import CurrentDac
from hpdl.tes.impedance import AdcParams, adc_convert


@dataclass(frozen=True)
class CmvhParams:
    """CMVH settings (assumed values; the abstract names the mechanisms only).

    Parameters
    ----------
    calibrate : bool
        Run the digital calibration before stimulating.
    switch : bool
        Close the analog switch from the reference electrode to chip ground.
    r_switch_ohm : float
        On-resistance of the switch (assumption: 100 Ohm).
    r_cal_ohm : float
        Nominal on-chip calibration resistor (assumption: 5 kOhm, so +-1 mA gives +-5 V).
    r_cal_tolerance : float
        Relative standard deviation of the real calibration resistor from nominal (assumption: 0.1 %).
    cal_code : int
        Code magnitude used by the calibration (100 = 1 mA).
    cal_samples : int
        ADC samples averaged per calibration point.
    cal_fs_hz : float
        ADC rate during calibration (sets the noise per sample).
    """

    calibrate: bool = True
    switch: bool = True
    r_switch_ohm: float = 100.0
    r_cal_ohm: float = 5000.0
    r_cal_tolerance: float = 0.001
    cal_code: int = 100
    cal_samples: int = 4096
    cal_fs_hz: float = 100e3

    def __post_init__(self) -> None:
        for name in ("r_switch_ohm", "r_cal_ohm", "cal_fs_hz"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CmvhParams.{name} must be > 0, got {getattr(self, name)!r}")
        if self.cal_code < 1 or self.cal_samples < 1 or self.r_cal_tolerance < 0:
            raise ValueError("CmvhParams: cal_code and cal_samples must be >= 1, r_cal_tolerance >= 0")


@dataclass
class Calibration:
    """Result of :func:`calibrate`: estimates and the trims written (arrays of shape (n_channels,))."""

    gain_est: np.ndarray
    offset_est_a: np.ndarray
    gain_trim: np.ndarray
    offset_trim_a: np.ndarray
    r_cal_actual_ohm: float


def calibrate(dac: CurrentDac, params: CmvhParams, adc: AdcParams, rng: np.random.Generator) -> Calibration:
    """Estimate each channel's gain and offset through the calibration resistor and set the trims.

    Each point is the mean of ``cal_samples`` ADC conversions of ``i x R_cal_actual`` (DAC noise and ADC
    noise and quantisation included); the chip divides by the *nominal* ``r_cal_ohm``, so the resistor's
    tolerance becomes a common gain error (it does not unbalance channels). Trims are rounded to the trim
    DACs' resolution by :meth:`CurrentDac.set_trims`.

    Returns
    -------
    Calibration
    """
    n, c, k = dac.n_channels, params.cal_code, params.cal_samples
    r_actual = params.r_cal_ohm * (1.0 + params.r_cal_tolerance * rng.standard_normal())
    dac.set_trims(np.zeros(n), np.zeros(n))
    means = {}
    for code in (c, 0, -c):
        i = dac.output(np.full((k, n), code, dtype=np.int64))
        v = np.empty_like(i)
        for ch in range(n):
            v[:, ch], _ = adc_convert(i[:, ch] * r_actual, params.cal_fs_hz, adc, rng)
        means[code] = v.mean(axis=0) / params.r_cal_ohm
    lsb = dac.params.lsb_a
    # INL at +-c is part of what is measured; the two-point slope absorbs its odd part
    gain_est = (means[c] - means[-c]) / (2 * c * lsb) - 1.0
    offset_est = means[0]
    gain_trim = 1.0 / (1.0 + gain_est) - 1.0
    dac.set_trims(gain_trim, -offset_est)
    return Calibration(gain_est, offset_est, dac.gain_trim.copy(), dac.offset_trim_a.copy(), r_actual)


def common_mode(v_terminal: np.ndarray, fs_hz: float, window_s: float, settle_s: float = 0.0) -> dict:
    """Common-mode statistics of the electrode voltages, in V.

    The common mode is the mean over electrodes of the pin voltages, ``v_cm(t)`` (K,). Its slow part (what
    "held near 0 V" is about) is the mean over consecutive windows of ``window_s`` (whole carrier periods).
    Windows that start before ``settle_s`` (ramp-up and the double layers' start-up transient) are reported
    separately as ``startup_max_abs_dc_v`` and left out of ``max_abs_dc_v``.

    Parameters
    ----------
    v_terminal : (K, N) float, V.

    Returns
    -------
    dict: ``v_cm`` (K,), ``dc_windows`` (W,), ``max_abs_dc_v`` (largest |window mean| after settling),
    ``startup_max_abs_dc_v``, ``mean_dc_v``, ``ac_rms_v`` (rms of v_cm minus its window means).
    """
    v = np.asarray(v_terminal, dtype=np.float64)
    if v.ndim != 2:
        raise ValueError(f"v_terminal must be (n_samples, n_electrodes), got {v.shape}")
    vcm = v.mean(axis=1)
    w = max(1, int(round(window_s * fs_hz)))
    nw = max(1, vcm.size // w)
    blocks = vcm[: nw * w].reshape(nw, -1) if vcm.size >= w else vcm[None, :]
    dc = blocks.mean(axis=1)
    ac = blocks - dc[:, None]
    settled = np.arange(dc.size) * w >= settle_s * fs_hz - 1e-9
    if not settled.any():
        settled[-1] = True
    return {"v_cm": vcm, "dc_windows": dc, "max_abs_dc_v": float(np.max(np.abs(dc[settled]))),
            "startup_max_abs_dc_v": float(np.max(np.abs(dc[~settled]))) if (~settled).any() else 0.0,
            "mean_dc_v": float(dc[settled].mean()), "ac_rms_v": float(np.sqrt(np.mean(ac ** 2)))}
