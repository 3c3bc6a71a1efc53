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


def test_check_bad_file_raises_with_field(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(SHORT.replace("area_cm2: 2.0", "area_cm2: -2.0"))
    with pytest.raises(ValueError, match="electrodes.2.area_cm2"):
        run(["check", str(f)])


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
    assert cli.main(["tes", "check", str(bad)]) == 1
    assert "duration_s" in capsys.readouterr().err
