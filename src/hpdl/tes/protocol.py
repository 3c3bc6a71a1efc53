"""Stimulation protocol files (YAML): schema, validation with field-named errors, and conversion to a Scenario.

Units are in the key names (``_ma``, ``_hz``, ``_ohm``, ``_uf``, ``_cm2``, ``_s``, ``_deg``). Unknown keys are
errors, so a typo never silently falls back to a default. See ``hpdl/tes/examples/ti_hd.yaml``.
"""

from __future__ import annotations

import difflib

import math
from dataclasses import fields, replace
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hpdl.runtime.errors import HpdlError
from hpdl.tes import waveforms as wf
from hpdl.tes.channel import ChipClock, DacParams
from hpdl.tes.cmvh import CmvhParams
from hpdl.tes.impedance import AdcParams
from hpdl.tes.load import Drift, Electrode, Tissue
from hpdl.tes.ocp import OcpParams
from hpdl.tes.scenario import Fault, Scenario, TiPair

EXAMPLE = "ti_hd.yaml"


class ProtocolError(HpdlError, ValueError):
    """A protocol file is malformed; the message names the file and the offending field."""


class _Strict(BaseModel):
    # NaN or inf in a current, time or limit makes every comparison of a check False or crashes the DAC model
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DriftSpec(_Strict):
    final_ratio: float = Field(gt=0)
    tau_s: float = Field(gt=0)


class ElectrodeSpec(_Strict):
    name: str = Field(min_length=1)
    position: str = ""
    area_cm2: float = Field(gt=0)
    r_s_ohm: float = Field(default=1000.0, gt=0)
    r_ct_ohm: float = Field(default=5000.0, ge=0)
    c_dl_uf: float = Field(default=1.0, ge=0)
    drift: DriftSpec | None = None


class ChipSpec(_Strict):
    name: str = Field(min_length=1)
    clock_ppm: float = Field(default=0.0, ge=-1e4, le=1e4)
    clock_phase_s: float = 0.0


class ChannelSpec(_Strict):
    name: str = Field(min_length=1)
    chip: str
    electrode: str


class _Ramps(_Strict):
    ramp_up_s: float = Field(default=0.0, ge=0)
    ramp_down_s: float = Field(default=0.0, ge=0)


class DcSpec(_Ramps):
    type: Literal["dc"]
    amplitude_ma: float


class SineSpec(_Ramps):
    type: Literal["sine"]
    amplitude_ma: float = Field(ge=0)
    freq_hz: float = Field(gt=0)
    phase_deg: float = 0.0
    offset_ma: float = 0.0


class ArbitrarySpec(_Ramps):
    type: Literal["arbitrary"]
    samples_ma: list[float] = Field(min_length=1)
    sample_rate_hz: float = Field(gt=0)
    repeat: bool = True


class RampSpec(_Ramps):
    type: Literal["ramp"]
    start_ma: float
    end_ma: float
    t0_s: float = Field(ge=0)
    t1_s: float = Field(gt=0)


WaveformSpec = Annotated[Union[DcSpec, SineSpec, ArbitrarySpec, RampSpec], Field(discriminator="type")]


class TiFieldSpec(_Strict):
    """E-field of each pair at one point per 1 mA of pair current (V/m per mA), e.g. from a leadfield."""

    point: str = Field(min_length=1)
    e1_v_per_m_per_ma: tuple[float, float, float]
    e2_v_per_m_per_ma: tuple[float, float, float]
    direction: tuple[float, float, float] | None = None


class TiPairSpec(_Strict):
    name: str = Field(min_length=1)
    f1_hz: float = Field(gt=0)
    f2_hz: float = Field(gt=0)
    amplitude1_ma: float = Field(ge=0)
    amplitude2_ma: float = Field(ge=0)
    pair1: tuple[str, str]
    pair2: tuple[str, str]
    ramp_up_s: float = Field(default=0.0, ge=0)
    ramp_down_s: float = Field(default=0.0, ge=0)
    fields: list[TiFieldSpec] = Field(default_factory=list)


class TissueSpec(_Strict):
    model: Literal["star", "edges"] = "star"
    r_spread_ohm: float = Field(default=300.0, gt=0)
    edges: list[tuple[str, str, float]] = Field(default_factory=list)


class LimitsSpec(_Strict):
    """Safety limits checked by ``hpdl tes check`` and the simulation's safety report (defaults are
    assumptions of this model, not a standard: set them for your study)."""

    max_channel_current_ma: float = Field(default=2.5, gt=0)
    max_total_current_ma: float = Field(default=4.0, gt=0)
    max_current_density_ma_cm2: float = Field(default=2.5, gt=0)
    max_charge_imbalance_nc: float = Field(default=50.0, gt=0)
    min_compliance_headroom_v: float = Field(default=0.5, ge=0)
    max_common_mode_mv: float = Field(default=50.0, gt=0)


class ModelSpec(_Strict):
    """Overrides of the chip-model parameters, by dataclass field name (see hpdl.tes.channel etc.)."""

    dac: dict[str, float] = Field(default_factory=dict)
    adc: dict[str, float | int | list[float]] = Field(default_factory=dict)
    cmvh: dict[str, float | int | bool] = Field(default_factory=dict)
    ocp: dict[str, float | int] = Field(default_factory=dict)


class FaultSpec(_Strict):
    channel: str
    t_start_s: float = Field(ge=0)
    t_end_s: float = Field(default=math.inf, allow_inf_nan=True)  # inf: the fault lasts to the end
    v_rail_v: float = 15.0
    r_ohm: float = Field(default=10.0, gt=0)


class ProtocolSpec(_Strict):
    """Top level of a protocol file."""

    name: str = Field(min_length=1)
    duration_s: float = Field(gt=0, le=600)
    sample_rate_hz: float | None = Field(default=None, gt=0)
    seed: int = 0
    chips: list[ChipSpec] = Field(min_length=1)
    electrodes: list[ElectrodeSpec] = Field(min_length=2)
    reference: str | None = None
    tissue: TissueSpec = Field(default_factory=TissueSpec)
    channels: list[ChannelSpec] = Field(min_length=1)
    waveforms: dict[str, WaveformSpec] = Field(default_factory=dict)
    ti_pairs: list[TiPairSpec] = Field(default_factory=list)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    model: ModelSpec = Field(default_factory=ModelSpec)
    impedance_window_s: float = Field(default=0.05, gt=0)
    faults: list[FaultSpec] = Field(default_factory=list)


def _loc(loc) -> str:
    return ".".join(str(x) for x in loc) or "<top level>"


def _first_problem(errors: list[dict]) -> str:
    """The most useful of pydantic's errors, as ``field.path: problem``.

    A misspelt key produces two errors, "extra key" and "required field missing"; the misspelling is the cause,
    so it is reported first, with the missing key of the same mapping it most resembles.
    """
    for err in errors:
        if err["type"] != "extra_forbidden":
            continue
        parent, key = tuple(err["loc"][:-1]), str(err["loc"][-1])
        missing = [str(e["loc"][-1]) for e in errors if e["type"] == "missing" and tuple(e["loc"][:-1]) == parent]
        close = difflib.get_close_matches(key, missing, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else (f" (missing: {', '.join(missing)})" if missing else "")
        return f"{_loc(err['loc'])}: unknown key{hint}"
    err = errors[0]
    return f"{_loc(err['loc'])}: {err['msg']}"


def _cross_check(p: ProtocolSpec) -> None:
    """Checks that span fields; raise ValueError('field: message')."""
    def unique(items, what):
        seen = set()
        for i, x in enumerate(items):
            if x.name in seen:
                raise ValueError(f"{what}.{i}.name: duplicate name {x.name!r}")
            seen.add(x.name)
        return seen

    chips, els, chans = unique(p.chips, "chips"), unique(p.electrodes, "electrodes"), unique(p.channels, "channels")
    used = set()
    for i, ch in enumerate(p.channels):
        if ch.chip not in chips:
            raise ValueError(f"channels.{i}.chip: unknown chip {ch.chip!r}; known: {sorted(chips)}")
        if ch.electrode not in els:
            raise ValueError(f"channels.{i}.electrode: unknown electrode {ch.electrode!r}; known: {sorted(els)}")
        if ch.electrode in used:
            raise ValueError(f"channels.{i}.electrode: electrode {ch.electrode!r} is already driven by a channel")
        if ch.electrode == p.reference:
            raise ValueError(f"channels.{i}.electrode: {ch.electrode!r} is the CMVH reference and cannot be driven")
        used.add(ch.electrode)
    if p.reference is not None and p.reference not in els:
        raise ValueError(f"reference: unknown electrode {p.reference!r}; known: {sorted(els)}")
    for name in p.waveforms:
        if name not in chans:
            raise ValueError(f"waveforms.{name}: unknown channel {name!r}; known: {sorted(chans)}")
    in_ti = {}
    for i, t in enumerate(p.ti_pairs):
        for key in ("pair1", "pair2"):
            for ch in getattr(t, key):
                if ch not in chans:
                    raise ValueError(f"ti_pairs.{i}.{key}: unknown channel {ch!r}; known: {sorted(chans)}")
                if ch in p.waveforms or ch in in_ti:
                    raise ValueError(f"ti_pairs.{i}.{key}: channel {ch!r} already has a waveform")
                in_ti[ch] = i
        if len(set(t.pair1) | set(t.pair2)) != 4:
            raise ValueError(f"ti_pairs.{i}: pair1 and pair2 need four distinct channels")
        for j, fs in enumerate(t.fields):
            if fs.direction is not None and not any(fs.direction):
                raise ValueError(f"ti_pairs.{i}.fields.{j}.direction: must be non-zero")
    if p.sample_rate_hz is not None:
        top = max([w.freq_hz for w in p.waveforms.values() if isinstance(w, SineSpec)]
                  + [f for t in p.ti_pairs for f in (t.f1_hz, t.f2_hz)], default=0.0)
        if p.sample_rate_hz < 10 * top:
            raise ValueError(f"sample_rate_hz: {p.sample_rate_hz:g} Hz is below 10 x the highest carrier "
                             f"({top:g} Hz); the model needs the carriers well resolved")
        # an arbitrary waveform's samples must each land on the grid, or a check never sees some of them
        arb = max([w.sample_rate_hz for w in p.waveforms.values() if isinstance(w, ArbitrarySpec)], default=0.0)
        if p.sample_rate_hz < 5 * arb:
            raise ValueError(f"sample_rate_hz: {p.sample_rate_hz:g} Hz is below 5 x the fastest arbitrary "
                             f"waveform's sample rate ({arb:g} Hz); samples between grid points would go unchecked")
    k = round(p.duration_s * default_sample_rate(p))
    if k < 1:
        raise ValueError(f"duration_s: {p.duration_s:g} s is shorter than one sample at "
                         f"{default_sample_rate(p):g} Hz; nothing would be checked")
    for i, w in enumerate(p.waveforms.values()):
        if isinstance(w, RampSpec) and not w.t1_s > w.t0_s:
            raise ValueError(f"waveforms.{list(p.waveforms)[i]}.t1_s: must be > t0_s")
    for i, f in enumerate(p.faults):
        if f.channel not in chans:
            raise ValueError(f"faults.{i}.channel: unknown channel {f.channel!r}")
        if not f.t_end_s > f.t_start_s:  # nan too (t_end_s alone may be .inf)
            raise ValueError(f"faults.{i}.t_end_s: must be > t_start_s ({f.t_start_s:g} s), got {f.t_end_s}")
    if p.tissue.model == "edges":
        for i, (a, b, r) in enumerate(p.tissue.edges):
            for x in (a, b):
                if x not in els:
                    raise ValueError(f"tissue.edges.{i}: unknown electrode {x!r}")
            if not r > 0:
                raise ValueError(f"tissue.edges.{i}: resistance must be > 0, got {r}")
    # a limit above the chip's own range is meaningless and would read as "allowed up to X mA"
    full_ma = 1e3 * p.model.dac.get("full_scale_a", DacParams.full_scale_a)
    if p.limits.max_channel_current_ma > full_ma * (1 + 1e-9):
        raise ValueError(f"limits.max_channel_current_ma: {p.limits.max_channel_current_ma:g} mA is above the "
                         f"chip's range of {full_ma:g} mA per channel; set it to at most {full_ma:g}")
    for section, cls in (("dac", DacParams), ("adc", AdcParams), ("cmvh", CmvhParams), ("ocp", OcpParams)):
        known = {f.name for f in fields(cls)}
        for key in getattr(p.model, section):
            if key not in known:
                raise ValueError(f"model.{section}.{key}: unknown parameter; known: {sorted(known)}")


def parse(data: dict, source: str = "<protocol>") -> ProtocolSpec:
    """Validate a protocol given as a dict (parsed YAML).

    Raises
    ------
    ProtocolError
        Message ``"<source>: <field.path>: <problem>"`` for the first problem found.
    """
    if not isinstance(data, dict):
        raise ProtocolError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        spec = ProtocolSpec.model_validate(data)
    except ValidationError as exc:
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ProtocolError(f"{source}: {_first_problem(exc.errors())}{more}") from None
    try:
        _cross_check(spec)
        to_scenario(spec).validate()  # parameter dataclasses validate their own ranges
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"{source}: {exc}") from None
    return spec


def load(path: str | Path | None = None) -> ProtocolSpec:
    """Read and validate a YAML protocol; ``None`` loads the packaged example (``examples/ti_hd.yaml``).

    >>> p = load(None)
    >>> p.name, [c.name for c in p.channels], p.reference
    ('ti-hd-demo', ['A1', 'A2', 'B1', 'B2'], 'Cz')

    Raises ProtocolError (bad YAML or content) or FileNotFoundError.
    """
    if path is None:
        text, source = resources.files("hpdl.tes").joinpath("examples", EXAMPLE).read_text(), EXAMPLE
    else:
        text, source = Path(path).read_text(), str(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProtocolError(f"{source}: not valid YAML: {exc}") from None
    return parse(data, source)


def default_sample_rate(p: ProtocolSpec) -> float:
    """``sample_rate_hz`` if given, else 50 x the highest carrier rounded up to 1 kHz (at least 20 kHz)."""
    if p.sample_rate_hz:
        return float(p.sample_rate_hz)
    freqs = [w.freq_hz for w in p.waveforms.values() if isinstance(w, SineSpec)]
    freqs += [f for t in p.ti_pairs for f in (t.f1_hz, t.f2_hz)]
    freqs += [w.sample_rate_hz / 2 for w in p.waveforms.values() if isinstance(w, ArbitrarySpec)]
    return float(max(20_000, 1000 * math.ceil(50 * max(freqs, default=0) / 1000)))


def _waveform(w) -> wf.Waveform:
    ramps = dict(ramp_up_s=w.ramp_up_s, ramp_down_s=w.ramp_down_s)
    if isinstance(w, DcSpec):
        return wf.Dc(amplitude_a=w.amplitude_ma * 1e-3, **ramps)
    if isinstance(w, SineSpec):
        return wf.Sine(amplitude_a=w.amplitude_ma * 1e-3, freq_hz=w.freq_hz, phase_rad=math.radians(w.phase_deg),
                       offset_a=w.offset_ma * 1e-3, **ramps)
    if isinstance(w, ArbitrarySpec):
        return wf.Arbitrary(samples_a=tuple(x * 1e-3 for x in w.samples_ma), sample_rate_hz=w.sample_rate_hz,
                            repeat=w.repeat, **ramps)
    return wf.Ramp(start_a=w.start_ma * 1e-3, end_a=w.end_ma * 1e-3, t0_s=w.t0_s, t1_s=w.t1_s, **ramps)


def to_scenario(p: ProtocolSpec) -> Scenario:
    """Build the simulator's Scenario (SI units) from a validated protocol."""
    el_index = {e.name: i for i, e in enumerate(p.electrodes)}
    chip_index = {c.name: i for i, c in enumerate(p.chips)}
    ch_index = {c.name: i for i, c in enumerate(p.channels)}
    electrodes = [Electrode(e.name, e.r_s_ohm, e.r_ct_ohm, e.c_dl_uf * 1e-6, e.area_cm2, e.position,
                            Drift(e.drift.final_ratio, e.drift.tau_s) if e.drift else None) for e in p.electrodes]
    waves: list[wf.Waveform] = [_waveform(p.waveforms[c.name]) if c.name in p.waveforms else wf.Off()
                                for c in p.channels]
    pairs = []
    for t in p.ti_pairs:
        ramps = dict(ramp_up_s=t.ramp_up_s, ramp_down_s=t.ramp_down_s)
        for (src, snk), f, a in ((t.pair1, t.f1_hz, t.amplitude1_ma), (t.pair2, t.f2_hz, t.amplitude2_ma)):
            waves[ch_index[src]] = wf.Sine(amplitude_a=a * 1e-3, freq_hz=f, **ramps)
            waves[ch_index[snk]] = wf.Sine(amplitude_a=a * 1e-3, freq_hz=f, phase_rad=math.pi, **ramps)
        pairs.append(TiPair(t.name, (ch_index[t.pair1[0]], ch_index[t.pair1[1]]),
                            (ch_index[t.pair2[0]], ch_index[t.pair2[1]]), t.f1_hz, t.f2_hz,
                            t.amplitude1_ma * 1e-3, t.amplitude2_ma * 1e-3,
                            tuple((fs.point, tuple(1e3 * x for x in fs.e1_v_per_m_per_ma),
                                   tuple(1e3 * x for x in fs.e2_v_per_m_per_ma), fs.direction) for fs in t.fields)))
    adc_over = {k: (tuple(v) if isinstance(v, list) else v) for k, v in p.model.adc.items()}
    if "bits" in adc_over:
        adc_over["bits"] = int(adc_over["bits"])
    return Scenario(
        electrodes=electrodes, channels=[c.name for c in p.channels],
        channel_terminal=[el_index[c.electrode] for c in p.channels], waveforms=waves,
        duration_s=p.duration_s, fs_hz=default_sample_rate(p),
        tissue=Tissue(p.tissue.model, p.tissue.r_spread_ohm, tuple(tuple(e) for e in p.tissue.edges)),
        channel_chip=[chip_index[c.chip] for c in p.channels],
        clocks=[ChipClock(c.clock_ppm, c.clock_phase_s) for c in p.chips],
        reference=el_index[p.reference] if p.reference is not None else None,
        dac=replace(DacParams(), **p.model.dac), adc=replace(AdcParams(), **adc_over),
        cmvh=replace(CmvhParams(switch=p.reference is not None), **p.model.cmvh),
        ocp=replace(OcpParams(), **p.model.ocp),
        faults=tuple(Fault(ch_index[f.channel], f.t_start_s, f.t_end_s, f.v_rail_v, f.r_ohm) for f in p.faults),
        ti_pairs=tuple(pairs), im_window_s=p.impedance_window_s, seed=p.seed)
