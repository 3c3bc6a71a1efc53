"""Defects found by a hostile review of the comm redesign (ed2e5fc), each a test that failed before its fix."""

import pytest

from hpdl.testing import get_pool

import _review_cases as R


@pytest.mark.timeout(120)
def test_is_completed_turns_true_and_finishes_the_result_without_wait():
    p = 3
    for r, out in enumerate(get_pool(p).run(R.is_completed_polls)):
        assert out["avg"] == (True, [2.0] * 10)
        assert out["all_gather"] == (True, [float(q) for q in range(p) for _ in range(2)])
        assert out["reduce_scatter"] == (True, [float(p * (2 * r + j) + sum(range(p))) for j in range(2)])
        assert out["non_contiguous"] == (True, [3.0] * 12)


def _rule(**kw):
    import json

    return json.dumps({"rules": [{"device": "cpu", "max_bytes": 1 << 20, "algorithm": "direct", **kw}]})


@pytest.mark.parametrize("fields,match", [
    ({"algorithm": "dierct"}, "got 'dierct'"),                       # misspelled: failed only at the first call
    ({"algorithm": "pairwise"}, "does not implement all_reduce"),    # all_reduce auto -> AttributeError
    ({"algorithm": "ring", "collective": "all_to_all"}, "does not implement all_to_all"),
    ({"algorithm": "auto"}, "does not implement"),
    ({"collective": "bcast"}, "collective must be one of"),          # silently never matched
    ({"device": "CPU"}, "device must be"),                           # silently never matched
    ({"max_bytes": "1M"}, "max_bytes must be"),                      # TypeError at call time
    ({"window": 0}, "window must be"),
])
def test_tuning_file_rules_are_checked_when_loaded(fields, match, tmp_path, monkeypatch):
    from hpdl.comm import tuning

    with pytest.raises(ValueError, match="tuning table 't.json', rule 0") as info:
        tuning.TuningTable.from_json(_rule(**fields), source="t.json")
    assert match in str(info.value)
    path = tmp_path / "t.json"
    path.write_text(_rule(**fields))
    monkeypatch.setenv("HPDL_TUNING_FILE", str(path))
    tuning.set_table(None)
    try:
        with pytest.raises(ValueError, match="rule 0"):
            tuning.resolve("all_reduce", 8, 4, "cpu")
    finally:
        tuning.set_table(None)


def test_tuning_file_not_json_names_the_file_and_aliases_are_canonical():
    from hpdl.comm import tuning

    with pytest.raises(ValueError, match="'t.json' is not valid JSON"):
        tuning.TuningTable.from_json("{rules", source="t.json")
    # aliases load as canonical names: "rd" reached list(REGISTRY).index() in the argument check and raised
    t = tuning.TuningTable.from_json(_rule(algorithm="rd", collective="allreduce"), source="t.json")
    assert t.select("all_reduce", 8, 4, "cpu") == ("recursive_doubling", None)
    assert tuning.default_table().validated().rules == tuning.default_table().rules
    with pytest.raises(ValueError, match="does not implement all_reduce"):
        tuning.set_table(tuning.TuningTable([tuning.Rule("cpu", 8, "push")]))
    tuning.set_table(None)


@pytest.mark.timeout(120)
def test_non_positive_or_nan_timeout_is_rejected_before_communicating():
    p = 3
    for errors, x in get_pool(p).run(R.bad_timeouts):
        assert all(kind == "ValueError" and "timeout must be a finite number" in msg for kind, msg in errors), errors
        assert x == [float(p)] * 4


@pytest.mark.timeout(200)
@pytest.mark.parametrize("spelling,meant", [("allgather", "all_gather"), ("all_to_all", "alltoall")])
def test_bench_takes_both_spellings_of_a_collective(spelling, meant):
    """`hpdl bench allgather` was "invalid choice" while `allreduce` / `alltoall` are spelled without underscores."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "hpdl.cli", "bench", spelling, "--np", "2", "-b", "64", "-e", "64",
                          "--algorithms", "native", "--iters", "3", "--warmup", "0", "--time-per-point", "0.01",
                          "--format", "json"], capture_output=True, text=True, timeout=180, env=env, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert data["meta"]["collective"] == meant and [r["wrong"] for r in data["rows"]] == [0]
