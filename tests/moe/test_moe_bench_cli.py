"""`hpdl moe` commands and the bench's per-rank body on a tiny sweep (2 gloo ranks from the test pool)."""
import json
from dataclasses import asdict

import numpy as np
import pytest

from hpdl.cli import main
from hpdl.moe.bench import BenchSpec, bench_rank, prepare, summarise
from hpdl.moe.trace import Trace
from hpdl.runtime.errors import CLIUsageError
from hpdl.testing import get_pool


def test_bench_rank_tiny_sweep():
    spec = BenchSpec(world_size=2, experts=[4], batches=[1, 3], hidden_size=32, n_layers=3, n_heads=4,
                     n_kv_heads=2, expert_size=32, prompt_len=6, new_tokens=3, repeats=2, profile_tokens=512,
                     time_limit=5)
    prep = prepare(spec, 4)
    assert prep["model_config"]["hidden_size"] == 32 and prep["model_config"]["n_experts"] == 4  # recorded
    rows = summarise(get_pool(2).run(bench_rank, asdict(spec), 4, prep))  # raises if ExFlow tokens differ
    # the baseline gathers only the prompts once (global request ids); ExFlow also K/V rows every step
    assert {r["mode"] for r in rows} == {"baseline", "exflow", "exflow_contiguous", "baseline_padded",
                                         "exflow_padded"}
    by = {(r["mode"], r["batch_per_rank"]): r for r in rows}
    for b in (1, 3):
        base, ex = by["baseline", b], by["exflow", b]
        assert base["a2a_calls_per_layer"] == 2.0 and ex["a2a_calls_per_layer"] < 2.0
        assert base["speedup_vs_baseline"] == 1.0 and ex["tokens_per_s"] > 0
        assert len(ex["a2a_bytes_per_layer"]) == 3 and ex["gather_bytes"] > 10 * base["gather_bytes"]
        assert by["exflow_padded", b]["count_seconds"] == 0 < ex["count_seconds"]
        assert by["exflow_padded", b]["gather_calls"] == ex["gather_calls"]  # fixed-size gathers in both
        pad = by["exflow_padded", b]
        assert "speedup_vs_baseline_padded" in pad and "speedup_vs_baseline_padded" not in ex
        assert len(pad["decode_seconds_all"]) == 2 and pad["decode_seconds"] > 0
        # shares from sums over ranks; decode apart (ExFlow's decode rows: one per request per layer per step)
        assert ex["cross_share"] == ex["rows_cross"] / ex["rows_dispatched"]
        assert ex["rows_dispatched_decode"] == 2 * b * 3 * (3 - 1)  # 2 ranks x b requests x 3 layers x 2 steps
    # the cross-rank share is a share of sums: rank shares 1/1 and 0/9 give 0.1, not a mean of 0.5
    fake = [[dict(rows[0], rows_cross=1, rows_dispatched=1)], [dict(rows[0], rows_cross=0, rows_dispatched=9)]]
    for r in fake:
        r[0]["rank"] = 0
    assert summarise(fake)[0]["cross_share"] == 0.1


def test_cli_affinity_and_place(tmp_path, capsys):
    rng = np.random.default_rng(0)
    grp = rng.integers(0, 2, 3000)
    e = np.stack([grp * 4 + rng.integers(0, 4, 3000) for _ in range(4)], 1)[:, :, None]
    Trace(e, {"n_experts": 8, "top_k": 1, "model": {"arch": "synthetic"}, "data": {"source": "planted"}}).save(
        tmp_path / "t.npz")
    assert main(["moe", "affinity", str(tmp_path / "t.npz"), "--plot", str(tmp_path / "h.png"),
                 "--json", str(tmp_path / "a.json")]) == 0
    assert (tmp_path / "h.png").stat().st_size > 1000
    assert json.loads((tmp_path / "a.json").read_text())["mean"]["mutual_information_bits"] > 0.5
    assert main(["moe", "place", str(tmp_path / "t.npz"), "--world-size", "2", "--out",
                 str(tmp_path / "p.json"), "--time-limit", "10"]) == 0
    out = capsys.readouterr().out
    assert "held-out cross-GPU share" in out
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["heldout"]["placement"] < 0.1 and d["world_size"] == 2
    assert main(["moe", "place", str(tmp_path / "t.npz"), "--world-size", "3", "--out", str(tmp_path / "q.json")]) == 1
    assert "world_size=3" in capsys.readouterr().err


def test_gpu_layer_script_runs_on_cpu(tmp_path):
    """benchmarks/moe_gpu_layer.py (meant for 1 x H200) in --smoke mode on the CPU: every kernel timed, the
    grouped experts equal to the per-expert loop, predictions labelled, three files written."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_gpu_layer.py"
    spec = importlib.util.spec_from_file_location("moe_gpu_layer_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--smoke", "--tokens", "16", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "moe_gpu_layer.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe_gpu_layer.json", "moe_gpu_layer.log",
                                                         "moe_gpu_layer.png"]
    assert {r["top_k"] for r in d["rows"]} == {1, 2} and "not measured" in d["machine_model"]["note"]
    for r in d["rows"]:
        assert all(r[f"{k}_us"] > 0 for k in ("grouped", "dense", "loop", "layer"))
        assert sum(r["expert_counts"]) == r["rows"] == 16 * r["top_k"]
    assert {p["gpus"] for p in d["prediction"]} == {8, 16, 32, 64}
    assert all(p["predicted_gain"] > 0 for p in d["prediction"])


def test_time_limit_setting(monkeypatch):
    import pytest

    from hpdl.moe import placement
    from hpdl.moe.errors import MoEError

    monkeypatch.setenv("HPDL_MOE_ILP_TIME_LIMIT", "0")
    with pytest.raises(MoEError, match="time_limit"):
        placement.place(np.ones((1, 4, 4)), 2)
    monkeypatch.setenv("HPDL_MOE_ILP_TIME_LIMIT", "5")
    assert placement.place(np.ones((1, 4, 4)), 2).status == "optimal"


def test_cli_train_then_trace(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["moe", "train", "--steps", "2", "--batch", "2", "--seq", "32", "--hidden", "16", "--layers", "2",
                 "--experts", "4", "--checkpoints", "2", "--max-bytes", "200000", "--out", str(out)]) == 0
    hist = json.loads((out / "history.json").read_text())
    assert [c["step"] for c in hist["checkpoints"]] == [0, 2] and (out / "affinity.png").is_file()
    assert main(["moe", "trace", "--model", str(out), "--tokens", "256", "--seq", "32",
                 "--out", str(tmp_path / "t.npz")]) == 0
    tr = Trace.load(tmp_path / "t.npz")
    assert tr.experts.shape == (256, 2, 1) and tr.meta["data"]["source"].startswith("stdlib-tail")
    assert "256 tokens x 2 MoE layers" in capsys.readouterr().out


def test_every_moe_option_has_help():
    import argparse

    from hpdl.moe.cli import MoECommand

    parser = argparse.ArgumentParser()
    MoECommand.add_arguments(parser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"trace", "affinity", "place", "train", "bench"}
    bare = [f"{name} {a.option_strings or a.dest}" for name, p in sub.choices.items() for a in p._actions
            if not isinstance(a, argparse._HelpAction) and not a.help]
    assert not bare, bare


def test_bench_spec_refused_before_spawning(tmp_path, capsys):
    import pytest

    from hpdl.models.gpt_moe import MoEConfig, MoEDecoder, save_checkpoint
    from hpdl.moe.bench import check_spec
    from hpdl.moe.errors import MoEError

    for kw, words in ((dict(new_tokens=0), "new_tokens"), (dict(batches=[0, 4]), "batches"),
                      (dict(repeats=0), "repeats"), (dict(world_size=3), "world_size=3"),
                      (dict(experts=[]), "experts")):
        with pytest.raises(MoEError, match=words):
            check_spec(BenchSpec(**kw))
    save_checkpoint(MoEDecoder(MoEConfig(n_experts=4, top_k=2, hidden_size=16, n_layers=2)), tmp_path / "m")
    with pytest.raises(MoEError, match="n_experts=4"):
        check_spec(BenchSpec(world_size=2, model=str(tmp_path / "m")))
    with pytest.raises(MoEError, match="top_k=2"):
        check_spec(BenchSpec(world_size=2, experts=[4], model=str(tmp_path / "m")))
    with pytest.raises(SystemExit) as exc:   # a parse-time usage error now (issue 37: every count is bounded)
        main(["moe", "bench", "--new-tokens", "0", "--out", str(tmp_path / "b.json")])
    assert exc.value.code == 2 and "argument --new-tokens: must be an integer in [1, " in capsys.readouterr().err


def test_cli_trace_bad_window(tmp_path, capsys):
    from hpdl.models.gpt_moe import MoEConfig, MoEDecoder, save_checkpoint

    save_checkpoint(MoEDecoder(MoEConfig(hidden_size=16, n_layers=2, max_position=64)), tmp_path / "m")
    import pytest

    argv = ["moe", "trace", "--model", str(tmp_path / "m"), "--tokens", "256", "--out", str(tmp_path / "t.npz")]
    with pytest.raises(SystemExit) as exc:   # a parse-time usage error now (issue 37: every count is bounded)
        main(argv + ["--seq", "0"])
    assert exc.value.code == 2 and "argument --seq: must be an integer in [1, " in capsys.readouterr().err
    assert main(argv + ["--seq", "100"]) == 1
    assert "exceeds the model's max_position=64" in capsys.readouterr().err


def test_cli_empty_trace(tmp_path, capsys):
    Trace(np.zeros((0, 3, 1), int), {"n_experts": 4}).save(tmp_path / "e.npz")
    assert Trace.load(tmp_path / "e.npz").n_experts == 4
    assert main(["moe", "affinity", str(tmp_path / "e.npz")]) == 1
    assert "empty trace" in capsys.readouterr().err
    assert main(["moe", "place", str(tmp_path / "e.npz"), "--world-size", "2", "--out", str(tmp_path / "p.json")]) == 1
    assert "0 tokens" in capsys.readouterr().err


def test_train_names_hidden_not_head_dim(tmp_path, capsys):
    """Issue 37 item 9: `moe train --hidden 60` blamed head_dim (an internal), not the flag the user typed."""
    assert main(["moe", "train", "--hidden", "60", "--steps", "1", "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "--hidden" in err and "multiple of 8" in err and "head_dim" not in err
    assert not (tmp_path / "m").exists()


def test_train_too_big_for_the_host_is_refused_before_allocating(tmp_path, capsys):
    """Issue 37 item 5: a model that cannot fit in host memory fails at once, naming the flags that size it."""
    assert main(["moe", "train", "--hidden", "65536", "--experts", "4096", "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "--hidden" in err and "free" in err


def test_bench_out_is_a_folder_and_the_older_json_spelling_still_works(tmp_path):
    """`--out` means a folder in every `hpdl bench` plug-in; `--out X.json` (README's spelling) still names the
    JSON file with the figure beside it, and with no output flag the files land here as before."""
    import argparse

    from hpdl.moe.bench import MoEBenchCommand, MoEBenchmark

    def parsed(*argv):
        p = argparse.ArgumentParser()
        MoEBenchCommand.add_arguments(p)
        args = p.parse_args(["--world-size", "2", "--experts", "2", *argv])
        MoEBenchmark().validate(args)
        return args

    a = parsed("--out", str(tmp_path / "r.json"))
    assert (a.json_path, a.plot_path, a.out_dir) == (str(tmp_path / "r.json"), str(tmp_path / "r.png"), None)
    a = parsed("--out", str(tmp_path / "d"))
    assert (a.json_path, a.plot_path, a.out_dir) == (None, None, str(tmp_path / "d"))
    a = parsed()
    assert (a.json_path, a.plot_path) == ("moe_bench.json", "moe_bench.png")
    with pytest.raises(CLIUsageError, match="--experts"):
        parsed("--batches", "1,x")


def test_study_entry_points_take_options_without_a_command_line(tmp_path):
    """Issue 40: the library steps take typed options (no argparse Namespace); the flags come from their fields."""
    import argparse
    import dataclasses

    from hpdl.moe.cli import MoECommand
    from hpdl.moe.study import AffinityOptions, PlaceOptions, TraceOptions, affinity, place
    from hpdl.moe.train import TrainOptions

    rng = np.random.default_rng(0)
    Trace(rng.integers(0, 4, size=(400, 3, 1)), {"n_experts": 4}).save(tmp_path / "t.npz")
    s = affinity(AffinityOptions(trace=str(tmp_path / "t.npz"), json=str(tmp_path / "a.json")))
    assert s["n_experts"] == 4 and json.loads((tmp_path / "a.json").read_text())["n_tokens"] == s["n_tokens"]
    res, heldout = place(PlaceOptions(trace=str(tmp_path / "t.npz"), world_size=2, method="greedy"))
    assert sorted(np.bincount(res.ranks.ravel())) == [6, 6] and 0 <= heldout["placement"] <= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "t.npz"]   # out=None: no placement written
    with pytest.raises(CLIUsageError, match="--hidden must be a multiple of 8"):
        TrainOptions(hidden=20)
    with pytest.raises(CLIUsageError, match="--top-k must be <= --experts=2"):
        TrainOptions(experts=2, top_k=3)
    cfg = TrainOptions(hidden=64, layers=3, experts=4, seq=512).model_config()
    assert (cfg.hidden_size, cfg.n_layers, cfg.n_experts, cfg.expert_size, cfg.max_position) == (64, 3, 4, 128, 512)
    # every option field is a flag of its sub-command, and nothing else is
    parser = argparse.ArgumentParser()
    MoECommand.add_arguments(parser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, cls in (("trace", TraceOptions), ("affinity", AffinityOptions), ("place", PlaceOptions),
                      ("train", TrainOptions)):
        dests = {a.dest for a in sub.choices[name]._actions} - {"help"}
        assert dests == {f.name for f in dataclasses.fields(cls) if "help" in f.metadata}, name


@pytest.mark.parametrize("kwargs, field", [
    ({"batch": 0}, "batch"), ({"lr": -1.0}, "lr"), ({"seq": 1}, "seq"), ({"steps": -3}, "steps"),
    ({"checkpoints": 0}, "checkpoints"), ({"hidden": "96"}, "hidden"), ({"top_k": 1.5}, "top_k")])
def test_train_options_from_python_are_checked_as_their_flags(kwargs, field):
    from hpdl.moe.study import PlaceOptions
    from hpdl.moe.train import TrainOptions

    with pytest.raises(CLIUsageError, match=rf"^{field} \(--{field.replace('_', '-')}\) must be "):
        TrainOptions(**kwargs)
    with pytest.raises(CLIUsageError, match=r"^world_size \(--world-size\) must be an integer in \[1, 4096\]"):
        PlaceOptions(trace="t.npz", world_size=0)
    with pytest.raises(CLIUsageError, match=r"^method \(--method\) must be one of"):
        PlaceOptions(trace="t.npz", world_size=2, method="magic")
