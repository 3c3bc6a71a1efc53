"""The stimulation scenario and the result of simulating it: the types every part of hpdl.tes shares.

:class:`Scenario` (montage, tissue, chip settings, waveforms, faults) is what :func:`hpdl.tes.simulate.simulate`
runs; :class:`SimResult` the waveforms it records and the logs :mod:`hpdl.tes.analysis` derives from them;
:func:`ground_paths` the pins' paths to chip ground that both the stepper and the impedance measurement use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hpdl.tes import impedance as im
from hpdl.tes.channel import ChipClock, CurrentDac, DacParams
from hpdl.tes.cmvh import Calibration, CmvhParams
from hpdl.tes.load import Electrode, Tissue
from hpdl.tes.ocp import OcpEvent, OcpParams
from hpdl.tes.waveforms import Waveform

MAX_RECORD_BYTES = 4 * 2**30  # recorded waveforms kept in memory
G_LEAK_S = 1e-12  # pin leakage to ground of a disconnected terminal (keeps the nodal matrix regular)


@dataclass(frozen=True)
class Fault:
    """Output-stage failure: channel ``channel``'s pin tied to ``v_rail_v`` through ``r_ohm`` from
    ``t_start_s`` until ``t_end_s`` (or until the OCP opens the channel's output switch)."""

    channel: int
    t_start_s: float
    t_end_s: float = math.inf
    v_rail_v: float = 15.0
    r_ohm: float = 10.0


@dataclass(frozen=True)
class TiPair:
    """Two balanced channel pairs: ``channels_1 = (source, sink)`` at ``f1_hz``, ``channels_2`` at ``f2_hz``."""

    name: str
    channels_1: tuple[int, int]
    channels_2: tuple[int, int]
    f1_hz: float
    f2_hz: float
    amplitude1_a: float
    amplitude2_a: float
    # optional fields per pair at named points: (name, E1 (3,), E2 (3,), direction (3,) or None), V/m per A
    fields: tuple = ()


@dataclass
class Scenario:
    """Everything one simulation needs (SI units; indices refer to ``electrodes`` and ``channels``)."""

    electrodes: list[Electrode]
    channels: list[str]
    channel_terminal: list[int]
    waveforms: list[Waveform]
    duration_s: float
    fs_hz: float
    tissue: Tissue = field(default_factory=Tissue)
    channel_chip: list[int] | None = None
    clocks: list[ChipClock] = field(default_factory=lambda: [ChipClock()])
    reference: int | None = None
    dac: DacParams = field(default_factory=DacParams)
    adc: im.AdcParams = field(default_factory=im.AdcParams)
    cmvh: CmvhParams = field(default_factory=CmvhParams)
    ocp: OcpParams = field(default_factory=OcpParams)
    faults: tuple[Fault, ...] = ()
    ti_pairs: tuple[TiPair, ...] = ()
    im_window_s: float = 0.05
    drift_update_s: float = 0.01
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the field when the scenario is inconsistent."""
        c = len(self.channels)
        if not (len(self.channel_terminal) == len(self.waveforms) == c) or c == 0:
            raise ValueError("Scenario: channels, channel_terminal and waveforms must be non-empty and equal length")
        if not (self.duration_s > 0 and self.fs_hz > 0):
            raise ValueError(f"Scenario: duration_s and fs_hz must be > 0, got {self.duration_s}, {self.fs_hz}")
        n_bytes = self.duration_s * self.fs_hz * 8 * (2 * len(self.electrodes) + 6 * c)
        if n_bytes > MAX_RECORD_BYTES:
            raise ValueError(f"Scenario: duration_s x fs_hz = {self.duration_s * self.fs_hz:.3g} samples needs "
                             f"{n_bytes / 2**30:.1f} GiB of waveforms (limit {MAX_RECORD_BYTES / 2**30:.0f} GiB); "
                             "simulate shorter stretches")
        if self.reference is not None:
            if not 0 <= self.reference < len(self.electrodes):
                raise ValueError(f"Scenario.reference must index electrodes, got {self.reference}")
            if self.reference in self.channel_terminal:
                raise ValueError("Scenario.reference: the CMVH reference electrode must not be driven by a channel")
        elif self.cmvh.switch:
            raise ValueError("Scenario.reference is required when cmvh.switch is on")
        chips = self.channel_chip or [0] * c
        if len(chips) != c or min(chips) < 0 or max(chips) >= len(self.clocks):
            raise ValueError(f"Scenario.channel_chip must have {c} entries indexing clocks")
        for f in self.faults:
            if not 0 <= f.channel < c:
                raise ValueError(f"Fault.channel must index channels, got {f.channel}")


@dataclass
class SimResult:
    """Recorded waveforms and derived logs of one run. Shapes: K samples, C channels, N electrodes."""

    scenario: Scenario
    t_s: np.ndarray             # (K,)
    codes: np.ndarray           # (K, C) int64, DAC codes
    i_target_a: np.ndarray      # (K, C) requested current before quantisation
    i_source_a: np.ndarray      # (K, C) source current actually delivered by each stage (after compliance)
    i_electrode_a: np.ndarray   # (K, N) current into each electrode (pin current), at mid-step
    v_terminal_v: np.ndarray    # (K, N) pin voltage against chip ground, at mid-step
    clipped: np.ndarray         # (K, C) bool, stage in compliance limit
    enabled: np.ndarray         # (K, C) bool, channel not latched off by the OCP
    ocp_events: list[OcpEvent]
    calibration: Calibration | None
    dac: CurrentDac
    impedance_log: list[dict] = field(default_factory=list)
    ti: list[dict] = field(default_factory=list)
    common_mode: dict = field(default_factory=dict)


def ground_paths(sc: Scenario, enabled: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-pin conductance to chip ground (S) and injected current (A) at time ``t``: output resistance of
    enabled channels, the CMVH switch on the reference, active faults, and a 1 pS leak everywhere."""
    n = len(sc.electrodes)
    g = np.full(n, G_LEAK_S)
    inj = np.zeros(n)
    for ch, term in enumerate(sc.channel_terminal):
        if enabled[ch]:
            g[term] += 1.0 / sc.dac.r_out_ohm
    if sc.cmvh.switch and sc.reference is not None:
        g[sc.reference] += 1.0 / sc.cmvh.r_switch_ohm
    for f in sc.faults:
        if enabled[f.channel] and f.t_start_s <= t < f.t_end_s:
            term = sc.channel_terminal[f.channel]
            g[term] += 1.0 / f.r_ohm
            inj[term] += f.v_rail_v / f.r_ohm
    return g, inj
