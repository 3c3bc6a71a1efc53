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
    d["limits"]["max_channel_current_ma"] = 25.0  # a protocol cannot lift the chip's own range
    d["limits"]["max_total_current_ma"] = 25.0
    d["limits"]["max_current_density_ma_cm2"] = 25.0
    rep = safety.check_protocol(protocol.parse(d))
    assert not rep["ok"]
    assert {c["name"] for c in rep["checks"] if not c["ok"]} == {"requested current within the chip's DAC range"}
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
