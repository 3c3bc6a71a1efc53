import argparse
import json

import pytest

from hpdl.tes.cli import TesCommand

SHORT = """
name: short
duration_s: 0.05
chips: [{name: c0}]
electrodes:
  - {name: E1, area_cm2: 1.0}
  - {name: E2, area_cm2: 1.0}
  - {name: REF, area_cm2: 2.0}
reference: REF
channels:
  - {name: ch1, chip: c0, electrode: E1}
  - {name: ch2, chip: c0, electrode: E2}
waveforms:
  ch1: {type: sine, amplitude_ma: 0.5, freq_hz: 100}
  ch2: {type: sine, amplitude_ma: 0.5, freq_hz: 100, phase_deg: 180}
impedance_window_s: 0.01
"""


def run(argv):
    parser = argparse.ArgumentParser()
    TesCommand.add_arguments(parser)
    return TesCommand().run(parser.parse_args(argv))


def test_check_example_table_and_json(capsys):
    assert run(["check"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert run(["check", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_check_bad_file_exits_2_naming_the_field(tmp_path, capsys):
    f = tmp_path / "bad.yaml"
    f.write_text(SHORT.replace("area_cm2: 2.0", "area_cm2: -2.0"))
    assert run(["check", str(f)]) == 2
    assert "electrodes.2.area_cm2" in capsys.readouterr().err


def test_missing_file_is_not_a_failed_check(tmp_path, capsys):
    for cmd in ("check", "simulate"):
        assert run([cmd, str(tmp_path / "nope.yaml")]) == 2
        err = capsys.readouterr().err
        assert "protocol file not found" in err and "nope.yaml" in err


def test_misspelt_key_is_named_with_a_suggestion(tmp_path, capsys):
    f = tmp_path / "typo.yaml"
    f.write_text(SHORT.replace("{type: sine, amplitude_ma: 0.5, freq_hz: 100}",
                               "{type: sine, amplitud_ma: 0.5, freq_hz: 100}"))
    assert run(["check", str(f)]) == 2
    err = capsys.readouterr().err
    assert "waveforms.ch1.sine.amplitud_ma: unknown key (did you mean 'amplitude_ma'?)" in err


def test_simulate_writes_outputs(tmp_path, capsys):
    f = tmp_path / "short.yaml"
    f.write_text(SHORT)
    out = tmp_path / "out"
    assert run(["simulate", str(f), "--out", str(out), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["safety"]["ok"] and data["impedance_log"]
    for name in ("summary.json", "waveforms.npz", "waveforms.png", "impedance_log.png", "safety.png"):
        assert (out / name).stat().st_size > 0


def test_group_is_registered_in_hpdl_cli():
    from hpdl.cli import GROUPS

    assert GROUPS["tes"][0] == "hpdl.tes.cli:TesCommand" and GROUPS["tes"][2] == "tes"


def test_missing_subcommand_is_a_usage_error():
    from hpdl.cli import CLIUsageError

    with pytest.raises(CLIUsageError):
        run([])


def test_through_the_hpdl_entry_point(monkeypatch, capsys, tmp_path):
    import hpdl.cli as cli

    monkeypatch.setattr(cli, "GROUPS", {"tes": cli.GROUPS["tes"]})  # other groups live on other branches
    assert cli.main(["tes", "check", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["protocol"] == "ti-hd-demo"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    assert cli.main(["tes", "check", str(bad)]) == 2  # could not check, not "checked and failed"
    assert "duration_s" in capsys.readouterr().err


def test_simulate_fails_a_protocol_that_check_fails(tmp_path, capsys):
    """3 mA exceeds the chip's 2.5 mA range: the DAC saturates at 2.498 mA, which alone looked safe."""
    f = tmp_path / "over.yaml"
    f.write_text(SHORT.replace("amplitude_ma: 0.5", "amplitude_ma: 3.0"))
    assert run(["check", str(f)]) == 1
    capsys.readouterr()
    out = tmp_path / "out"
    assert run(["simulate", str(f), "--out", str(out), "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["safety"]["ok"] is False
    failed = {c["name"] for c in data["safety"]["checks"] if not c["ok"]}
    assert "max channel current (requested)" in failed and "DAC saturation" in failed
    assert data["safety"]["static"]["ok"] is False
    assert json.loads((out / "summary.json").read_text())["safety"]["ok"] is False
    assert run(["simulate", str(f), "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "static check" in text


def test_safety_report_alone_flags_saturation():
    """The Python API (simulate + safety_report, no static check) must not pass a saturated protocol either."""
    from hpdl.tes import protocol, safety
    from hpdl.tes.simulate import simulate

    spec = protocol.parse(__import__("yaml").safe_load(SHORT.replace("amplitude_ma: 0.5", "amplitude_ma: 3.0")),
                          "over")
    rep = safety.safety_report(simulate(protocol.to_scenario(spec)), spec.limits)
    assert not rep["ok"]
    bad = {c["name"]: c for c in rep["checks"] if not c["ok"]}
    assert bad["max channel current (requested)"]["value"] == pytest.approx(3.0)
    assert bad["DAC saturation"]["value"] > 0


def test_check_of_a_long_protocol_covers_it_all_and_fails_late_breaches(tmp_path, capsys):
    """Issue 37: a protocol longer than 2e6 samples was checked over its first 0.2 s only, marked PASS, exit 0."""
    f = tmp_path / "late.yaml"  # 2.5e6 samples; the channels reach +-0.8 mA (total 0.8 > 0.5 mA) after 0.21 s
    f.write_text(SHORT.replace("duration_s: 0.05", "duration_s: 0.25\nsample_rate_hz: 1.0e7")
                 .replace("{type: sine, amplitude_ma: 0.5, freq_hz: 100}",
                          "{type: ramp, start_ma: 0, end_ma: 0.8, t0_s: 0.21, t1_s: 0.22}")
                 .replace("{type: sine, amplitude_ma: 0.5, freq_hz: 100, phase_deg: 180}",
                          "{type: ramp, start_ma: 0, end_ma: -0.8, t0_s: 0.21, t1_s: 0.22}")
                 + "limits: {max_total_current_ma: 0.5}\n")
    assert run(["check", str(f)]) == 1
    out = capsys.readouterr().out
    assert "checked every sample of the protocol: 0.25 s at 1e+07 Hz (2500000 samples per channel)" in out
    assert "were checked" not in out
