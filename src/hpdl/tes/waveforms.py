"""Per-channel target current waveforms, evaluated on the chip's own time axis (all currents in A).

Each waveform is ``shape(t) * ramp(t)``: the shape (DC, sine, arbitrary samples, linear ramp) times a
trapezoidal on/off ramp (``ramp_up_s``, ``ramp_down_s``) over the protocol's duration.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Waveform(ABC):
    """Base: on/off ramps (s) shared by every shape. Subclasses implement :meth:`shape`."""

    ramp_up_s: float = 0.0
    ramp_down_s: float = 0.0

    @abstractmethod
    def shape(self, t_s: np.ndarray) -> np.ndarray:
        """Target current in A at chip times ``t_s`` (K,), before the ramps; (K,) float64."""

    def __call__(self, t_s: np.ndarray, duration_s: float) -> np.ndarray:
        """Target current in A at chip times ``t_s`` (K,) for a protocol of ``duration_s``; (K,) float64."""
        t = np.asarray(t_s, dtype=np.float64)
        gain = np.ones_like(t)
        if self.ramp_up_s > 0:
            gain = np.minimum(gain, np.clip(t / self.ramp_up_s, 0.0, 1.0))
        if self.ramp_down_s > 0:
            gain = np.minimum(gain, np.clip((duration_s - t) / self.ramp_down_s, 0.0, 1.0))
        return self.shape(t) * gain

    @property
    def carriers_hz(self) -> tuple[float, ...]:
        """Sinusoidal carrier frequencies (chip time), used for impedance measurement; () if none."""
        return ()

    @property
    def period_s(self) -> float | None:
        """Repetition period for per-period charge balance, or None when the waveform is not periodic."""
        return None

    @property
    @abstractmethod
    def peak_a(self) -> float:
        """Largest |target| the shape can reach, A."""


@dataclass(frozen=True)
class Dc(Waveform):
    """Constant current ``amplitude_a`` (tDCS)."""

    amplitude_a: float = 0.0

    def shape(self, t_s):
        return np.full_like(t_s, self.amplitude_a, dtype=np.float64)

    @property
    def peak_a(self):
        return abs(self.amplitude_a)


@dataclass(frozen=True)
class Sine(Waveform):
    """``offset_a + amplitude_a * cos(2 pi freq_hz t + phase_rad)`` (tACS, or one carrier of a TI pair)."""

    amplitude_a: float = 0.0
    freq_hz: float = 10.0
    phase_rad: float = 0.0
    offset_a: float = 0.0

    def __post_init__(self) -> None:
        if not self.freq_hz > 0:
            raise ValueError(f"Sine.freq_hz must be > 0, got {self.freq_hz!r}")

    def shape(self, t_s):
        return self.offset_a + self.amplitude_a * np.cos(2 * np.pi * self.freq_hz * t_s + self.phase_rad)

    def phase(self, t_s: np.ndarray) -> np.ndarray:
        """Carrier phase in rad at chip times ``t_s`` (the I/Q reference)."""
        return 2 * np.pi * self.freq_hz * np.asarray(t_s, dtype=np.float64) + self.phase_rad

    @property
    def carriers_hz(self):
        return (self.freq_hz,)

    @property
    def period_s(self):
        return 1.0 / self.freq_hz

    @property
    def peak_a(self):
        return abs(self.offset_a) + abs(self.amplitude_a)


@dataclass(frozen=True)
class Arbitrary(Waveform):
    """Sample list played at ``sample_rate_hz`` (zero-order hold); ``repeat`` loops it, else 0 after the end."""

    samples_a: tuple[float, ...] = (0.0,)
    sample_rate_hz: float = 1000.0
    repeat: bool = True

    def __post_init__(self) -> None:
        if len(self.samples_a) < 1 or not self.sample_rate_hz > 0:
            raise ValueError("Arbitrary needs >= 1 sample and sample_rate_hz > 0")

    def shape(self, t_s):
        x = np.asarray(self.samples_a, dtype=np.float64)
        idx = np.floor(np.asarray(t_s) * self.sample_rate_hz + 1e-9).astype(np.int64)
        if self.repeat:
            return x[np.mod(idx, x.size)]
        out = np.zeros(idx.shape)
        ok = (idx >= 0) & (idx < x.size)
        out[ok] = x[idx[ok]]
        return out

    @property
    def period_s(self):
        return len(self.samples_a) / self.sample_rate_hz if self.repeat else None

    @property
    def peak_a(self):
        return float(np.max(np.abs(self.samples_a)))


@dataclass(frozen=True)
class Ramp(Waveform):
    """Linear ramp from ``start_a`` at ``t0_s`` to ``end_a`` at ``t1_s``, held constant outside."""

    start_a: float = 0.0
    end_a: float = 0.0
    t0_s: float = 0.0
    t1_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.t1_s > self.t0_s:
            raise ValueError(f"Ramp needs t1_s > t0_s, got {self.t0_s!r}, {self.t1_s!r}")

    def shape(self, t_s):
        a = np.clip((np.asarray(t_s) - self.t0_s) / (self.t1_s - self.t0_s), 0.0, 1.0)
        return self.start_a + (self.end_a - self.start_a) * a

    @property
    def peak_a(self):
        return max(abs(self.start_a), abs(self.end_a))


@dataclass(frozen=True)
class Off(Waveform):
    """No current (an idle channel)."""

    def shape(self, t_s):
        return np.zeros_like(t_s, dtype=np.float64)

    @property
    def peak_a(self):
        return 0.0
