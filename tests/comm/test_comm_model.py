"""The alpha-beta-gamma model: textbook limits, calibration recovers known parameters, labelled CLI output."""

import json
import math
from dataclasses import replace

import pytest

from hpdl.comm import model as M

UNIT = M.Machine("unit", 4, 4, alpha_intra=1.0, beta_intra=0.0, alpha_inter=10.0, beta_inter=0.0, gamma=0.0)


def test_latency_terms_count_messages():
    # alpha only: ring = 2(p-1) inter messages; two_level = 2(g-1) intra + 2(N-1) inter (one chunk)
    assert M.allreduce_time(UNIT, "ring", 16, 1000) == 2 * 15 * 10.0
    assert M.allreduce_time(UNIT, "two_level", 16, 1000) == 2 * 3 * 1.0 + 2 * 3 * 10.0
    # one node: the inter terms vanish
    assert M.allreduce_time(UNIT, "two_level", 4, 1000) == 2 * 3 * 1.0
    # alltoall: pairwise p-g inter messages, push N-1 of them
    assert M.alltoall_time(UNIT, "pairwise", 16, 1600) == 3 * 1.0 + 12 * 10.0
    assert M.alltoall_time(UNIT, "push", 16, 1600) == 2 * 1.0 + 3 * 10.0


def test_bandwidth_terms_match_thakur_rabenseifner_gropp():
    m = replace(UNIT, alpha_intra=0.0, alpha_inter=0.0, beta_inter=1.0, beta_intra=1.0, gamma=0.5)
    p, n = 8, 800.0
    # ring: 2(p-1)/p n beta + (p-1)/p n gamma
    assert M.allreduce_time(m, "ring", p, n) == pytest.approx(2 * 7 / 8 * n + 7 / 8 * n * 0.5)
    # rails shared: 8 ranks on 4 rails double the inter-node bytes of direct
    one = M.allreduce_time(replace(m, gpus_per_node=8, rails=8), "direct", 16, n)
    shared = M.allreduce_time(replace(m, gpus_per_node=8, rails=4), "direct", 16, n)
    assert shared > one


def test_multi_rail_two_level_beats_single_rail_ring_at_scale():
    m = M.PRESETS["h100-ndr"]
    for p in (32, 256, 1024):
        assert M.allreduce_time(m, "two_level", p, 1 << 30) < M.allreduce_time(m, "ring", p, 1 << 30)
    assert M.win_range(m, "allreduce", "two_level", "ring", 256) is not None


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="multiple of ranks per node"):
        M.allreduce_time(UNIT, "ring", 6, 10)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        M.allreduce_time(UNIT, "butterfly", 8, 10)
    with pytest.raises(ValueError, match="collective"):
        M.predict(UNIT, "bcast", "ring", 8, 10)


def test_calibration_recovers_parameters_from_synthetic_measurements():
    truth = M.Machine("truth", 4, 4, alpha_intra=3e-6, beta_intra=2e-10, alpha_inter=4e-5, beta_inter=1e-9,
                      gamma=5e-10, copy_in=True)
    samples = [M.Sample(c, a, 8, 4, n, M.predict(truth, c, a, 8, n, 4, 4))
               for c, algos in (("allreduce", ("ring", "direct", "two_level")), ("alltoall", M.ALLTOALL))
               for a in algos for n in [1 << k for k in range(10, 25, 2)]]
    fit = M.calibrate(samples)
    for s, row in zip(samples, M.compare_table(fit, samples)):
        assert abs(row["error_pct"]) < 1.0, row
    assert fit.alpha_inter == pytest.approx(truth.alpha_inter, rel=0.05)
    assert fit.beta_inter == pytest.approx(truth.beta_inter, rel=0.05)


def test_cli_prints_labelled_predictions_and_calibration(tmp_path, capsys):
    from hpdl.cli import main

    truth = M.Machine("truth", 2, 2, 1e-5, 1e-10, 1e-4, 2e-9, 1e-9, copy_in=True)
    rows = [{"size": n, "resolved": a, "wrong": 0, "avg_us": M.predict(truth, "allreduce", a, 4, n, 2, 2) * 1e6}
            for a in ("ring", "direct", "two_level") for n in (1 << 12, 1 << 16, 1 << 20, 1 << 22)]
    path = tmp_path / "ar.json"
    path.write_text(json.dumps({"meta": {"world_size": 4, "ranks_per_node": 2, "collective": "allreduce"},
                                "rows": rows}))
    assert main(["bench", "model", "--calibrate", str(path), "--plot", str(tmp_path / "m.png")]) == 0
    out = capsys.readouterr().out
    assert "MEASURED vs MODEL" in out and "PREDICTION (not measured)" in out and "2.8x" in out
    # the predicted speed-ups are labelled ratio columns, not raw field names
    assert "vs ring 1 rail (speed-up, higher is better)" in out and "vs_ring_1_rail" not in out
    assert "vs ring all rails (speed-up, higher is better)" in out and "two_level (us)" in out
    assert (tmp_path / "m.png").stat().st_size > 0
    assert main(["bench", "model", "--format", "json", "--machine", "gh200-ss11"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["p"] for r in data["prediction_speedup"]} == {32, 256, 1024}
    assert all(math.isfinite(r["vs_ring_1_rail"]) for r in data["prediction_speedup"])
