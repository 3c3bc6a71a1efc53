import copy

import pytest
import yaml

from hpdl.tes import protocol
from hpdl.tes.protocol import ProtocolError


@pytest.fixture()
def example():
    from importlib import resources

    return yaml.safe_load(resources.files("hpdl.tes").joinpath("examples", "ti_hd.yaml").read_text())


def test_example_loads_and_converts(example):
    p = protocol.load(None)
    sc = protocol.to_scenario(p)
    assert sc.channels == ["A1", "A2", "B1", "B2"]
    assert sc.electrodes[sc.reference].name == "Cz"
    assert sc.waveforms[1].phase_rad == pytest.approx(3.141592653589793)  # pair sink in anti-phase
    assert sc.fs_hz == 101000.0
    assert protocol.parse(example).name == "ti-hd-demo"


def _set(d, path, value):
    cur = d
    for k in path[:-1]:
        cur = cur[k]
    if value is _DEL:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value


_DEL = object()


@pytest.mark.parametrize("path,value,field", [
    (["duration_s"], _DEL, "duration_s"),
    (["duration_s"], -1, "duration_s"),
    (["electrodes", 0, "area_cm2"], 0, "electrodes.0.area_cm2"),
    (["electrodes", 1, "r_s_ohm"], "high", "electrodes.1.r_s_ohm"),
    (["channels", 1, "electrode"], "Oz", "channels.1.electrode"),
    (["channels", 0, "chip"], "chip9", "channels.0.chip"),
    (["channels", 0, "electrode"], "Cz", "channels.0.electrode"),
    (["reference"], "Fp1", "reference"),
    (["ti_pairs", 0, "pair2"], ["B1", "A1"], "ti_pairs.0"),
    (["ti_pairs", 0, "f1_hz"], 0, "ti_pairs.0.f1_hz"),
    (["waveforms"], {"A1": {"type": "sine", "amplitude_ma": 1, "freq_hz": 10}}, "ti_pairs.0.pair1"),
    (["waveforms"], {"Q9": {"type": "dc", "amplitude_ma": 1}}, "waveforms.Q9"),
    (["waveforms"], {"A1": {"type": "square", "amplitude_ma": 1}}, "waveforms.A1"),
    (["tissue"], {"model": "star", "r_spread": 300}, "tissue.r_spread"),
    (["model"], {"dac": {"gain_sgima": 0.01}}, "model.dac.gain_sgima"),
    (["model"], {"dac": {"lsb_a": -1}}, "lsb_a"),
    (["chips", 1, "name"], "chip0", "chips.1.name"),
    (["sample_rate_hz"], 5000, "sample_rate_hz"),
])
def test_bad_protocols_are_rejected_with_the_field_named(example, path, value, field):
    bad = copy.deepcopy(example)
    _set(bad, path, value)
    with pytest.raises(ProtocolError) as info:
        protocol.parse(bad, "p.yaml")
    msg = str(info.value)
    assert msg.startswith("p.yaml: ") and field in msg, msg


def test_bad_yaml_and_top_level(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("name: [unclosed\n")
    with pytest.raises(ProtocolError, match="not valid YAML"):
        protocol.load(f)
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ProtocolError, match="top level must be a mapping"):
        protocol.load(f)


def test_all_waveform_types(example):
    d = copy.deepcopy(example)
    d["ti_pairs"] = []
    d["waveforms"] = {"A1": {"type": "dc", "amplitude_ma": 0.5},
                      "A2": {"type": "sine", "amplitude_ma": 0.5, "freq_hz": 10, "offset_ma": 0.1},
                      "B1": {"type": "arbitrary", "samples_ma": [0.2, -0.2], "sample_rate_hz": 100},
                      "B2": {"type": "ramp", "start_ma": 0, "end_ma": -1, "t0_s": 0, "t1_s": 0.5}}
    sc = protocol.to_scenario(protocol.parse(d))
    assert [type(w).__name__ for w in sc.waveforms] == ["Dc", "Sine", "Arbitrary", "Ramp"]
    assert sc.waveforms[3](__import__("numpy").array([0.25]), 0.5)[0] == pytest.approx(-0.5e-3)
