"""benchmarks/offload_plot.py against the committed device run: the plotted overlaps are the ones its goal
lines state, and the PNG is written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "docs" / "benchmarks" / "data" / "offload" / "2026-12-04_1929" / "offload.json"


def _module():
    spec = importlib.util.spec_from_file_location("offload_plot", ROOT / "benchmarks" / "offload_plot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_series_match_the_runs_goal_lines():
    mod, doc = _module(), json.loads(RUN.read_text())
    osu = mod.osu_series(doc)
    assert osu["agent"]["sizes"] == [65536, 262144, 1048576]
    # offload.log: agent Eff% 72.0 / 67.3 / 80.4, native 20.3 / 33.1 / 50.8 (from the median times)
    assert [round(x[0], 1) for x in osu["agent"]["eff"]] == [72.0, 67.3, 80.4]
    assert [round(x[0], 1) for x in osu["native"]["eff"]] == [20.3, 33.1, 50.8]
    assert all(lo <= hi for _, lo, hi in osu["agent"]["eff"])
    gpu, missing = mod.gpu_series(doc)
    assert missing == []
    assert round(gpu["MPS"]["agent-ce"][0], 1) == 90.2 and gpu["MPS"]["agent-ce"][3] == 5
    assert round(gpu["no-MPS"]["graph"][0], 1) == 36.4 and gpu["no-MPS"]["graph"][3] == 8


def test_writes_png_and_names_a_failed_mode(tmp_path):
    pytest.importorskip("matplotlib")
    mod, doc = _module(), json.loads(RUN.read_text())
    doc["results"]["gpu"]["MPS"]["graph"] = "failed: RuntimeError: boom"
    _, missing = mod.gpu_series(doc)
    assert missing == ["MPS graph: failed: RuntimeError: boom"]
    src = tmp_path / "run.json"
    src.write_text(json.dumps(doc))
    assert mod.main([str(src), str(tmp_path / "out.png")]) == 0
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rejects_a_json_that_is_not_the_benchmarks(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit):
        _module().main([str(bad), str(tmp_path / "x.png")])
