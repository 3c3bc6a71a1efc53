import pytest

from hpdl.tes import spec
from hpdl.tes.cli import _markdown


def test_dac_step_and_range_through_the_model():
    rows = spec.check_dac()
    assert all(r.ok for r in rows), [r.modelled for r in rows]
    steps = rows[0].detail["steps_ua"]
    assert len(steps) == 500 and min(steps) > 5 and max(steps) < 15


def test_compliance_rows():
    assert all(r.ok for r in spec.check_compliance())


def test_impedance_loads_cover_the_range():
    for f in (10.0, 2000.0):
        loads = spec.impedance_loads(20, f)
        z = [abs(e.impedance(f)) + 2.0 for e in loads]
        assert z[0] == pytest.approx(500, rel=1e-6) and z[-1] == pytest.approx(500e3, rel=1e-6)


def test_markdown_escapes_pipes_and_marks_info_rows():
    rows = [spec.SpecRow("a", "|V| <= 13 V", "|V| = 1", True), spec.SpecRow("b", "-", "x", None),
            spec.SpecRow("c", "-", "y", False)]
    from hpdl.bench.common import run_metadata

    md = _markdown(rows, "x.png", "x.json", 1.0, run_metadata(command="hpdl tes spec --quick", versions=("numpy",)))
    assert "UTC by `hpdl tes spec --quick`" in md
    assert "\\|V\\| <= 13 V" in md and "| info |" in md and "| FAIL |" in md and "`hpdl tes spec --quick`" in md and "`x.json`" in md


def test_impedance_in_ti_montage_row():
    rows = spec.check_impedance_in_montage(seeds=(1,), duration_s=0.3)
    assert rows[0].ok, rows[0].modelled
