import pytest

from hpdl.comm import tuning
from hpdl.comm.ops import normalize_op, shard_bounds


def test_default_table_picks_by_size_and_device():
    t = tuning.default_table()
    assert t.select(8, 4, "cpu")[0] == "native"     # CG's 8-byte dot products: gloo's C++ all-reduce (issue 41)
    assert t.select(8, 8, "cpu")[0] == "native" and t.select(48 << 10, 6, "cpu")[0] == "native"
    # 8 ranks: the 16-core host's measured table (docs/benchmarks/data/apps/2026-12-04_1729_comm_apps)
    assert [t.select(n, 8, "cpu")[0] for n in (64, 4 << 10, 32 << 10)] == ["recursive_doubling"] * 3
    assert [t.select(n, 8, "cpu")[0] for n in (48 << 10, 1 << 20, 4 << 20)] == ["direct", "direct", "native"]
    assert t.select(256 << 10, 4, "cpu")[0] == "direct"
    assert t.select(64 << 20, 4, "cpu")[0] == "native"
    assert t.select(8, 1, "cpu")[0] == "native"
    assert t.select(8, 2, "cuda")[0] == "one_shot"
    assert t.select(64 << 20, 2, "cuda")[0] == "two_shot"
    assert t.select(8, 16, "cuda")[0] == "native"  # beyond one node's 8 GPUs


def test_table_roundtrip_and_env(tmp_path, monkeypatch):
    t = tuning.TuningTable([tuning.Rule("cpu", 100, "ring"), tuning.Rule("cpu", tuning.INF, "direct", 2)], "x")
    path = tmp_path / "t.json"
    path.write_text(t.to_json())
    monkeypatch.setenv("HPDL_TUNING_FILE", str(path))
    tuning.set_table(None)
    try:
        assert tuning.select(50, 4, "cpu") == ("ring", None)
        assert tuning.select(500, 4, "cpu") == ("direct", 2)
    finally:
        monkeypatch.delenv("HPDL_TUNING_FILE")
        tuning.set_table(None)
    with pytest.raises(ValueError, match="malformed"):
        tuning.TuningTable.from_json('{"rules": [{"device": "cpu"}]}')


def test_shard_bounds_cover_exactly():
    for n in (0, 1, 7, 8, 97):
        for p in (1, 3, 8):
            b = shard_bounds(n, p)
            assert b[0][0] == 0 and b[-1][1] == n and all(b[i][1] == b[i + 1][0] for i in range(p - 1))
            sizes = [e - s for s, e in b]
            assert max(sizes) - min(sizes) <= 1


def test_normalize_op():
    import torch.distributed as dist

    assert normalize_op("SUM") == "sum" and normalize_op(dist.ReduceOp.MAX) == "max" and normalize_op("prod") == "product"
    with pytest.raises(ValueError, match="op must be one of"):
        normalize_op("xor")
