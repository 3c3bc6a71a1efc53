"""Switched-capacitor over-current protection (OCP): sampled comparator with a trip filter and a latch.

Model (assumed circuit; the abstract says only "switched-capacitor OCP"): each channel's pin current is
mirrored onto a sense node; on every OCP clock tick a sampling capacitor moves a fraction
``alpha = 1 - exp(-T_clk / tau_sample)`` towards ``|i_pin|`` (charge sharing), then a comparator with a
per-channel offset compares it with the threshold. ``n_consecutive`` ticks above threshold trip the channel,
which latches off (its output switch opens) until reset. Worst-case response after a step over threshold is
``(n_consecutive + settling ticks) / f_clk`` plus the simulator step in which the switch opens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class OcpParams:
    """OCP parameters (all assumptions).

    Parameters
    ----------
    threshold_a : float
        Trip current (assumption: 3 mA, 20 % above the 2.5 mA full scale).
    clock_hz : float
        Comparator clock (assumption: 2 MHz).
    tau_sample_s : float
        Settling time constant of the sampling capacitor (assumption: 100 ns).
    n_consecutive : int
        Ticks above threshold needed to trip (assumption: 2; rejects single-tick glitches).
    offset_sigma_a : float
        Comparator offset, referred to the current, standard deviation (assumption: 30 uA).
    response_time_s : float
        The response-time specification the model is checked against (assumption: 5 us).
    """

    threshold_a: float = 3e-3
    clock_hz: float = 2e6
    tau_sample_s: float = 100e-9
    n_consecutive: int = 2
    offset_sigma_a: float = 30e-6
    response_time_s: float = 5e-6

    def __post_init__(self) -> None:
        for name in ("threshold_a", "clock_hz", "tau_sample_s", "response_time_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"OcpParams.{name} must be > 0, got {getattr(self, name)!r}")
        if self.n_consecutive < 1 or self.offset_sigma_a < 0:
            raise ValueError("OcpParams: n_consecutive must be >= 1 and offset_sigma_a >= 0")


@dataclass
class OcpEvent:
    """One trip: channel index, time the comparator tripped (s) and the sensed current then (A)."""

    channel: int
    t_trip_s: float
    i_sensed_a: float


@dataclass
class Ocp:
    """OCP state of ``n_channels`` channels. Call :meth:`step` once per simulator step."""

    n_channels: int
    params: OcpParams
    rng: np.random.Generator
    events: list[OcpEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.offset_a = self.params.offset_sigma_a * self.rng.standard_normal(self.n_channels)
        self.v_s = np.zeros(self.n_channels)  # sampled (current-equivalent) value, A
        self.count = np.zeros(self.n_channels, dtype=np.int64)
        self.latched = np.zeros(self.n_channels, dtype=bool)
        self._next_tick = 0  # index of the next comparator tick
        self._alpha = 1.0 - np.exp(-1.0 / (self.params.clock_hz * self.params.tau_sample_s))
        # the sampler never exceeds the largest current it saw, so below every threshold no comparator can count
        self._quiet = 0.999 * float(np.min(self.params.threshold_a + self.offset_a))
        self._vs_max = 0.0
        self._counting = False
        self._none = np.zeros(self.n_channels, dtype=bool)

    def step(self, t0_s: float, dt_s: float, i_pin_a: np.ndarray) -> np.ndarray:
        """Advance over ``[t0, t0 + dt)`` with pin currents ``i_pin_a`` (C,) A held constant.

        Returns a (C,) bool array of channels that tripped in this step (they are now latched).
        """
        p = self.params
        period = 1.0 / p.clock_hz
        end = math.ceil((t0_s + dt_s) * p.clock_hz - 1e-9)  # first tick index at or after the step end
        first = max(self._next_tick, math.ceil(t0_s * p.clock_hz - 1e-9))
        m = end - first
        self._next_tick = max(self._next_tick, end)
        if m <= 0:
            return self._none
        target = np.abs(i_pin_a)
        tmax = float(target.max())
        # fast path: nothing near threshold, the sampler only tracks (no comparator can count)
        if tmax < self._quiet and self._vs_max < self._quiet:
            decay = (1 - self._alpha) ** m
            self.v_s = target if decay < 1e-12 else target + (self.v_s - target) * decay
            self._vs_max = float(self.v_s.max())
            if self._counting:
                self.count[:] = 0
                self._counting = False
            return self._none
        self._counting = True
        th = p.threshold_a + self.offset_a
        # all m ticks at once: the sampler relaxes geometrically towards the (held) target
        decay = (1 - self._alpha) ** np.arange(1, m + 1)[:, None]  # (m, 1)
        v_all = target + (self.v_s - target) * decay  # (m, C)
        above = (v_all > th) & ~self.latched
        j = np.arange(m)[:, None]
        last_false = np.maximum.accumulate(np.where(~above, j, -1), axis=0)
        run = np.where(last_false >= 0, j - last_false, j + 1 + self.count)  # consecutive ticks above, per tick
        hit = run >= p.n_consecutive
        tripped = hit.any(axis=0)
        for ch in np.flatnonzero(tripped):
            jt = int(np.argmax(hit[:, ch]))
            self.latched[ch] = True
            self.events.append(OcpEvent(int(ch), float((first + jt) * period), float(v_all[jt, ch])))
        self.v_s = v_all[-1].copy()
        self.count = np.where(tripped, 0, run[-1])
        self._vs_max = float(self.v_s.max())
        return tripped

    def quiet(self, i_max_a: float) -> bool:
        """True when a pin current up to ``i_max_a`` cannot make any comparator count (fast-path guard)."""
        return i_max_a < self._quiet and self._vs_max < self._quiet and not self._counting

    def skip(self, t_end_s: float, i_last_a: np.ndarray) -> None:
        """Advance a quiet OCP to ``t_end_s``; the sampler ends tracking ``i_last_a`` (C,) A."""
        self._next_tick = max(self._next_tick, math.ceil(t_end_s * self.params.clock_hz - 1e-9))
        self.v_s = np.asarray(i_last_a, dtype=np.float64).copy()
        self._vs_max = float(self.v_s.max())

    def reset(self, channel: int) -> None:
        """Clear the latch of ``channel`` (the host's explicit re-enable)."""
        self.latched[channel] = False
        self.count[channel] = 0
