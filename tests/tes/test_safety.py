import copy

import numpy as np
import pytest
import yaml

from hpdl.tes import protocol, safety
from hpdl.tes.simulate import simulate


@pytest.fixture()
def example():
    from importlib import resources

    return yaml.safe_load(resources.files("hpdl.tes").joinpath("examples", "ti_hd.yaml").read_text())


def test_period_charges():
    fs = 1000.0
    i = np.tile([1.0, 1.0, -1.0, -1.5], 5)  # period 4 ms, net -0.5 A x 1 ms per period
    q = safety.period_charges(i, fs, 4e-3)
    assert q == pytest.approx(np.full(5, -0.5e-3))
    assert safety.period_charges(i[:3], fs, 4e-3).size == 0


def test_example_passes_static_check_and_simulation(example):
    p = protocol.parse(example)
    rep = safety.check_protocol(p)
    assert rep["ok"], rep["checks"]
    res = simulate(protocol.to_scenario(p))
    sim = safety.safety_report(res, p.limits)
    assert sim["ok"], sim["checks"]
    names = {c["name"] for c in sim["checks"]}
    assert {"charge imbalance per period", "current density", "compliance headroom", "OCP trips"} <= names
    assert sim["common_mode"]["max_abs_dc_mv"] < 10


def test_static_check_catches_overcurrent_density_and_compliance(example):
    d = copy.deepcopy(example)
    d["ti_pairs"][0]["amplitude1_ma"] = 3.0
    rep = safety.check_protocol(protocol.parse(d))
    failed = {c["name"] for c in rep["checks"] if not c["ok"]}
    assert {"max channel current", "requested current within the chip's DAC range"} <= failed
    assert any("DAC range" in w for w in rep["warnings"])
    d["limits"]["max_total_current_ma"] = 25.0  # lifting the other limits cannot hide the chip's own range
    d["limits"]["max_current_density_ma_cm2"] = 25.0
    rep = safety.check_protocol(protocol.parse(d))
    assert not rep["ok"]
    assert {c["name"] for c in rep["checks"] if not c["ok"]} == {"requested current within the chip's DAC range",
                                                                 "max channel current"}
    d = copy.deepcopy(example)
    d["electrodes"][2]["area_cm2"] = 0.3  # 1 mA on 0.3 cm^2
    d["limits"]["max_total_current_ma"] = 1.5
    rep = safety.check_protocol(protocol.parse(d))
    assert {c["name"] for c in rep["checks"] if not c["ok"]} == {"current density", "total current"}
    d = copy.deepcopy(example)
    d["electrodes"][0]["r_s_ohm"] = 200e3  # dry electrode: 1 mA would need 200 V
    rep = safety.check_protocol(protocol.parse(d))
    assert [c for c in rep["checks"] if c["name"].startswith("compliance")][0]["ok"] is False


def test_simulation_report_flags_clipping_and_ocp(example):
    d = copy.deepcopy(example)
    d["duration_s"] = 0.06
    d["electrodes"][0]["r_s_ohm"] = 200e3
    d["faults"] = [{"channel": "B1", "t_start_s": 0.03}]
    p = protocol.parse(d)
    res = simulate(protocol.to_scenario(p))
    rep = safety.safety_report(res, p.limits)
    bad = {c["name"] for c in rep["checks"] if not c["ok"]}
    assert {"compliance headroom", "OCP trips"} <= bad
    assert rep["ocp_events"][0]["channel"] == "B1" and rep["ocp_events"][0]["t_trip_s"] >= 0.03
    row = [r for r in rep["channels"] if r["channel"] == "A1"][0]
    assert row["clipped_pct"] > 0 and row["peak_delivered_ma"] < 0.1


def test_limit_above_the_chips_range_is_rejected_naming_the_field(example):
    d = copy.deepcopy(example)
    d["limits"]["max_channel_current_ma"] = 3.0  # the chip delivers at most 2.5 mA per channel
    with pytest.raises(protocol.ProtocolError, match=r"limits\.max_channel_current_ma: 3 mA is above .* 2\.5 mA"):
        protocol.parse(d)
    d["limits"]["max_channel_current_ma"] = 2.5  # at the range is fine
    assert protocol.parse(d).limits.max_channel_current_ma == 2.5
    d["model"] = {"dac": {"full_scale_a": 5e-3}}  # a modelled chip with a larger range may allow more
    d["limits"]["max_channel_current_ma"] = 3.0
    assert protocol.parse(d).limits.max_channel_current_ma == 3.0


LATE = {
    # 0.25 s at 10 MHz = 2.5e6 samples; the channels ramp to +-0.8 mA only after 0.21 s, breaking the 0.5 mA
    # total-current limit late in the protocol (an early version checked the first 2e6 samples and passed)
    "name": "late", "duration_s": 0.25, "sample_rate_hz": 1.0e7, "chips": [{"name": "c0"}],
    "electrodes": [{"name": "E1", "area_cm2": 1.0}, {"name": "E2", "area_cm2": 1.0}, {"name": "REF", "area_cm2": 2.0}],
    "reference": "REF",
    "channels": [{"name": "ch1", "chip": "c0", "electrode": "E1"}, {"name": "ch2", "chip": "c0", "electrode": "E2"}],
    "waveforms": {"ch1": {"type": "ramp", "start_ma": 0.0, "end_ma": 0.8, "t0_s": 0.21, "t1_s": 0.22},
                  "ch2": {"type": "ramp", "start_ma": 0.0, "end_ma": -0.8, "t0_s": 0.21, "t1_s": 0.22}},
    "limits": {"max_total_current_ma": 0.5},
}


def test_static_check_covers_every_sample_of_a_long_protocol():
    rep = safety.check_protocol(protocol.parse(copy.deepcopy(LATE)))
    assert rep["samples_checked"] == rep["samples_total"] == 2_500_000
    bad = {c["name"]: c for c in rep["checks"] if not c["ok"]}
    assert set(bad) == {"total current"} and bad["total current"]["value"] == pytest.approx(0.8)
    assert not rep["ok"]
    assert not any("checked" in w for w in rep["warnings"])


def test_streamed_period_charges_match_the_whole_record(monkeypatch, example):
    """The chunked check gives the same numbers whatever the chunk length (boundaries inside chunks)."""
    d = copy.deepcopy(example)
    d["duration_s"] = 0.05
    d["ti_pairs"] = []
    d["waveforms"] = {"A1": {"type": "arbitrary", "samples_ma": [1.0, -0.5, 0.3, -0.7], "sample_rate_hz": 333},
                      "A2": {"type": "sine", "amplitude_ma": 0.5, "freq_hz": 37, "offset_ma": 0.01},
                      "B1": {"type": "dc", "amplitude_ma": -0.4},
                      "B2": {"type": "ramp", "start_ma": 0.0, "end_ma": 0.3, "t0_s": 0.01, "t1_s": 0.03}}
    p = protocol.parse(d)
    whole = safety.check_protocol(p)
    monkeypatch.setattr(safety, "_CHECK_CHUNK", 977)
    chunked = safety.check_protocol(p)
    for a, b in zip(whole["checks"] + whole["channels"], chunked["checks"] + chunked["channels"]):
        for k, v in a.items():
            assert b[k] == (pytest.approx(v, rel=1e-9, abs=1e-12) if isinstance(v, float) else v), k
    # against the whole-record reference for the arbitrary waveform's period
    sc = protocol.to_scenario(p)
    t = np.arange(int(round(sc.duration_s * sc.fs_hz))) / sc.fs_hz
    from hpdl.tes.channel import quantize

    i = quantize(sc.waveforms[0](t, sc.duration_s), sc.dac) * sc.dac.lsb_a
    q = safety.period_charges(i, sc.fs_hz, sc.waveforms[0].period_s)
    assert chunked["channels"][0]["max_period_charge_nc"] == pytest.approx(1e9 * np.abs(q).max(), rel=1e-9)


def test_amplitudes_off_the_dac_step_are_reported_with_the_delivered_value(example):
    d = copy.deepcopy(example)
    d["ti_pairs"] = []
    d["waveforms"] = {"A1": {"type": "dc", "amplitude_ma": 1.0005},
                      "A2": {"type": "dc", "amplitude_ma": -1.0},
                      "B1": {"type": "sine", "amplitude_ma": 0.5, "freq_hz": 10, "offset_ma": 0.0123},
                      "B2": {"type": "arbitrary", "samples_ma": [0.1, 0.2345, -0.3333], "sample_rate_hz": 100}}
    rep = safety.check_protocol(protocol.parse(d))
    w = [x for x in rep["warnings"] if "DAC step" in x]
    assert len(w) == 3, rep["warnings"]
    assert w[0].startswith("waveforms.A1.amplitude_ma: 1.0005 mA is not a multiple of the DAC step (10 uA); "
                           "the chip delivers 1 mA")
    assert w[1].startswith("waveforms.B1.offset_ma: 0.0123 mA") and "delivers 0.01 mA" in w[1]
    assert w[2].startswith("waveforms.B2.samples_ma.1: 0.2345 mA") and "2 of 3 samples" in w[2]
    d = copy.deepcopy(example)
    d["ti_pairs"][0]["amplitude2_ma"] = 1.0005
    w = [x for x in safety.check_protocol(protocol.parse(d))["warnings"] if "DAC step" in x]
    assert w == ["ti_pairs.0.amplitude2_ma: 1.0005 mA is not a multiple of the DAC step (10 uA); the chip "
                 "delivers 1 mA (rounded to the nearest code)"]


def _two_channel(**over):
    d = dict(name="t", duration_s=0.01, chips=[{"name": "c0"}],
             electrodes=[{"name": "E1", "area_cm2": 1.0}, {"name": "E2", "area_cm2": 1.0},
                         {"name": "R", "area_cm2": 3.0}],
             reference="R", channels=[{"name": "A", "chip": "c0", "electrode": "E1"},
                                      {"name": "B", "chip": "c0", "electrode": "E2"}], waveforms={})
    d.update(over)
    return d


def test_sine_peak_between_samples_is_the_requested_peak():
    # 2.6 mA at 2 kHz sampled at 20 kHz with an 18 deg phase: every sample is at most cos(18 deg) x 2.6 = 2.47 mA,
    # but the protocol asks for 2.6 mA (above the chip's 2.5 mA range and the limit)
    d = _two_channel(sample_rate_hz=20000, waveforms={
        "A": {"type": "sine", "amplitude_ma": 2.6, "freq_hz": 2000, "phase_deg": 18},
        "B": {"type": "sine", "amplitude_ma": 2.6, "freq_hz": 2000, "phase_deg": 198}})
    rep = safety.check_protocol(protocol.parse(d))
    by = {c["name"]: c for c in rep["checks"]}
    assert by["max channel current"]["value"] == pytest.approx(2.6)
    assert not by["max channel current"]["ok"] and not rep["ok"]
    assert by["current density"]["value"] == pytest.approx(2.6) and not by["current density"]["ok"]  # 1 cm^2


def test_arbitrary_samples_faster_than_the_check_rate_are_refused():
    # one 5 mA sample in 100 played at 1 MHz: a 20 kHz check grid never lands on it
    d = _two_channel(sample_rate_hz=20000, waveforms={
        "A": {"type": "arbitrary", "samples_ma": [0.0] * 99 + [5.0], "sample_rate_hz": 1e6},
        "B": {"type": "dc", "amplitude_ma": 0.0}})
    with pytest.raises(protocol.ProtocolError, match="sample_rate_hz"):
        protocol.parse(d)


def test_a_protocol_shorter_than_one_sample_is_refused():
    d = _two_channel(duration_s=1e-6, waveforms={"A": {"type": "dc", "amplitude_ma": 2.0},
                                                 "B": {"type": "dc", "amplitude_ma": -2.0}})
    with pytest.raises(protocol.ProtocolError, match="duration_s"):
        protocol.parse(d)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_currents_are_refused_naming_the_field(value):
    d = _two_channel(waveforms={"A": {"type": "dc", "amplitude_ma": value}, "B": {"type": "dc", "amplitude_ma": 0}})
    with pytest.raises(protocol.ProtocolError, match="waveforms.A.dc.amplitude_ma"):
        protocol.parse(d)


def test_a_model_override_that_raises_the_chips_range_is_reported():
    # model.dac may model a larger chip (a design choice), but 40 mA DC then passed with no word at all
    d = _two_channel(model={"dac": {"full_scale_a": 0.1, "compliance_v": 1000.0}},
                     limits={"max_channel_current_ma": 50, "max_total_current_ma": 60,
                             "max_current_density_ma_cm2": 60},
                     waveforms={"A": {"type": "dc", "amplitude_ma": 40.0}, "B": {"type": "dc", "amplitude_ma": -40.0}})
    rep = safety.check_protocol(protocol.parse(d))
    text = " ".join(rep["warnings"])
    assert "model.dac.full_scale_a" in text and "2.5 mA" in text
    assert "model.dac.compliance_v" in text and "13 V" in text
    plain = safety.check_protocol(protocol.parse(_two_channel(waveforms={"A": {"type": "dc", "amplitude_ma": 1.0},
                                                                         "B": {"type": "dc", "amplitude_ma": -1.0}})))
    assert not any("model.dac" in w for w in plain["warnings"])


@pytest.mark.parametrize("t_end", [float("nan"), 0.0005])
def test_a_fault_must_end_after_it_starts(t_end):
    d = _two_channel(waveforms={"A": {"type": "dc", "amplitude_ma": 1.0}, "B": {"type": "dc", "amplitude_ma": -1.0}},
                     faults=[{"channel": "A", "t_start_s": 0.001, "t_end_s": t_end}])
    with pytest.raises(protocol.ProtocolError, match=r"faults\.0\.t_end_s"):
        protocol.parse(d)
    d["faults"][0]["t_end_s"] = float("inf")  # to the end of the protocol
    assert protocol.parse(d).faults[0].t_end_s == float("inf")
