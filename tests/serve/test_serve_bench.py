"""Benchmark workloads, metrics (checked on hand-made records), queue simulation, and the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hpdl.serve.baselines import simulate_static
from hpdl.serve.bench import RequestRecord, WorkloadRequest, make_workload, summarize


def test_workload_rates_and_lengths():
    wl = make_workload(4000, (4, 8), (32, 512), request_rate=10.0, seed=1, vocab_size=100)
    gaps = np.diff([w.arrival for w in wl])
    assert wl[0].arrival == 0 and abs(gaps.mean() - 0.1) < 0.01 and abs(gaps.std() / gaps.mean() - 1) < 0.1
    bursty = np.diff([w.arrival for w in make_workload(4000, request_rate=10.0, burstiness=0.25, seed=1)])
    assert bursty.std() / bursty.mean() > 1.5  # gamma shape 0.25: coefficient of variation 2
    assert all(4 <= len(w.prompt) <= 8 and 32 <= w.output_len <= 512 and max(w.prompt) < 100 for w in wl)
    assert all(w.arrival == 0 for w in make_workload(5))
    corpus = list(range(1000))
    w = make_workload(3, (10, 10), corpus_ids=corpus)[0]
    assert w.prompt == list(range(w.prompt[0], w.prompt[0] + 10))
    with pytest.raises(ValueError, match="output_len"):
        make_workload(3, output_len=(5, 2))
    with pytest.raises(ValueError, match="request_rate"):
        make_workload(3, request_rate=0)


def test_summarize_exact_values():
    recs = [RequestRecord(0.0, 4, [1.0, 1.5, 2.0]), RequestRecord(1.0, 4, [2.0, 4.0], finish=5.0)]
    s = summarize(recs, slo_ttft_ms=1000, slo_tpot_ms=600)
    assert s["makespan_s"] == 5.0 and s["request_throughput"] == 0.4 and s["output_throughput"] == 1.0
    assert s["mean_ttft_ms"] == 1000 and s["median_e2el_ms"] == 3000
    assert s["mean_tpot_ms"] == pytest.approx((500 + 3000) / 2)  # (E2EL - TTFT)/(n - 1)
    assert s["mean_itl_ms"] == pytest.approx((500 + 500 + 2000) / 3)
    assert s["goodput"] == pytest.approx(1 / 5)  # only the first meets TPOT <= 600 ms


def test_simulate_static_fifo():
    calib = {1: (1.0, 0.1), 2: (2.0, 0.2)}
    wl = [WorkloadRequest(0.0, [1], 3), WorkloadRequest(0.5, [1], 2), WorkloadRequest(0.6, [1], 4)]
    seq = simulate_static(wl, calib, 1)
    assert seq[0].token_times == pytest.approx([1.0, 1.1, 1.2]) and seq[1].token_times[0] == pytest.approx(2.2)
    st = simulate_static(wl, calib, 2)  # request 0 alone, then 1 and 2 together, run to the longer (4)
    assert st[1].finish == pytest.approx(1.2 + 2.0 + 3 * 0.2) and st[1].output_len == 2


def test_cli_bench_json(capsys):
    from hpdl.serve.cli import ServeCommand
    import argparse

    p = argparse.ArgumentParser()
    ServeCommand.add_arguments(p)
    args = p.parse_args(["bench", "--config", "llama-tiny", "--num-requests", "6", "--prompt-len", "4:8",
                         "--output-len", "2:6", "--max-seq-len", "32", "--num-slots", "4",
                         "--systems", "flover,static", "--static-batch-size", "2", "--format", "json"])
    assert ServeCommand().run(args) == 0
    doc = json.loads(capsys.readouterr().out)   # the harness's document: meta, roofline, one row per system
    out = {r["system"]: r for r in doc["rows"]}
    assert list(out) == ["flover", "static"] and out["flover"]["requests"] == 6 and out["static"]["requests"] == 6
    assert math.isfinite(out["flover"]["output_throughput"])
    assert doc["meta"]["device"] == "cpu" and doc["meta"]["date"].endswith("UTC")
    assert doc["meta"]["engine"]["config"] == "llama-tiny" and doc["meta"]["workload"]["num_requests"] == 6
    roof = doc["roofline"]  # the decode step against the measured bandwidth, 4 rows (= slots)
    assert roof["rows"] == 4 and roof["step_ms"] > 0 and 0 < roof["fraction"] == pytest.approx(
        roof["min_bytes"] / (roof["step_ms"] / 1e3) / roof["hbm_bytes_per_s"])


def test_roofline_bytes_and_line():
    from hpdl.serve import EngineConfig, LLMEngine, ModelSpec
    from hpdl.serve.bench import decode_roofline, roofline_line
    from hpdl.serve.fused import step_bytes
    from hpdl.serve.sampling import SamplingParams

    eng = LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(num_slots=4, max_seq_len=64))
    r = eng.executor.runner
    cfg = r.model.cfg
    # closed form: weights except the embedding table (n rows of it), K and V of n rows x (L + 1) positions
    weights = sum(p.numel() for n_, p in r.model.named_parameters() if n_ != "embed_tokens.weight") * 4
    want = weights + 3 * cfg.hidden_size * 4 + 2 * cfg.n_layers * 3 * cfg.n_kv_heads * cfg.head_dim * 11 * 4
    assert step_bytes(r.model, r.cache, 3, 10) == want
    roof = decode_roofline(eng, 3, 10, iters=3, hbm=1e9)
    assert roof["min_bytes"] == want and roof["path"] == "eager" and roof["hbm_bytes_per_s"] == 1e9
    assert "3 rows at 10 cached positions (eager)" in roofline_line(roof)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="idle"):
        decode_roofline(eng, 3, 10)


def test_cli_requires_exactly_one_model_source():
    import argparse

    from hpdl.cli import CLIUsageError
    from hpdl.serve.cli import ServeCommand

    p = argparse.ArgumentParser()
    ServeCommand.add_arguments(p)
    for argv in ([], ["--model", "x", "--config", "llama-tiny"]):
        with pytest.raises(CLIUsageError, match="exactly one"):
            ServeCommand().run(p.parse_args(argv))
    with pytest.raises(SystemExit):  # argparse: invalid choice, listing the configs
        p.parse_args(["--config", "nope"])


def test_cli_help_lists_every_config_and_shows_defaults():
    from hpdl.cli import build_parser
    from hpdl.serve.worker import NAMED_CONFIGS

    for argv in (["serve"], ["serve", "bench"], ["bench", "serve"]):
        parser = build_parser(argv[0])
        sub = parser._subparsers._group_actions[0].choices[argv[0]]
        if len(argv) > 1:
            sub = sub._subparsers._group_actions[0].choices[argv[1]]
        text = " ".join(sub.format_help().split())
        assert all(name in text for name in NAMED_CONFIGS), text
        assert "(default: 64)" in text and "(default: cpu)" in text and "(default: None)" not in text


def test_cli_device_cuda_without_cuda_names_the_option(capsys):
    import torch

    from hpdl.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["serve", "--config", "llama-tiny", "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert "--device cuda" in err and "CUDA is not available" in err and "Traceback" not in err


def test_bench_lengths_over_max_seq_len_are_a_usage_error_naming_the_flags(capsys):
    """Was an InvalidParamError from the engine after it was built ("prompt (128 tokens) + max_tokens ..."),
    naming none of the bench's flags."""
    from hpdl.cli import main

    assert main(["serve", "bench", "--config", "llama-tiny", "--num-requests", "2", "--output-len", "4:8",
                 "--max-seq-len", "64"]) != 0
    err = capsys.readouterr().err
    assert "--prompt-len up to 128 + --output-len up to 8 = 136 positions exceed --max-seq-len 64" in err


def test_bench_prefill_paths_side_by_side_and_their_usage_errors(capsys):
    """`--prefill padded,chunked` runs the same Poisson workload through one engine per prefill path."""
    from hpdl.cli import main

    base = ["serve", "bench", "--config", "llama-tiny", "--num-requests", "6", "--prompt-len", "2:40",
            "--output-len", "2:6", "--max-seq-len", "64", "--num-slots", "4", "--systems", "flover",
            "--request-rate", "200", "--format", "json"]
    assert main(base + ["--prefill", "padded,chunked", "--max-num-batched-tokens", "12"]) == 0
    out = {r["system"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert out["flover/padded"]["requests"] == out["flover/chunked"]["requests"] == 6
    assert out["flover/chunked"]["prefill_padding"] == 0 and "p99_ttft_ms" in out["flover/chunked"]
    assert main(base + ["--prefill", "chunked", "--max-num-batched-tokens", "4"]) != 0
    assert "--max-num-batched-tokens > --num-slots (4)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--prefill", "paged"])
    assert "expected a comma list of distinct modes among padded, packed, chunked, got 'paged'" in \
        capsys.readouterr().err


def test_bench_table_units_notes_order_and_files(capsys, tmp_path):
    """On the harness: every measured column has its unit in the header, this engine's rows (one per prefill path,
    named in full) come first, a row with a note is starred and explained under the table, and --out/--json/--plot
    write the document and the figure."""
    from hpdl.cli import main

    argv = ["serve", "bench", "--config", "llama-tiny", "--num-requests", "4", "--prompt-len", "2:6",
            "--output-len", "2:4", "--max-seq-len", "32", "--num-slots", "4", "--systems", "flover,sequential",
            "--request-rate", "400", "--prefill", "padded,packed", "--out", str(tmp_path / "o"),
            "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("# hpdl serve bench: ")   # the command as typed, not its alias `hpdl bench serve`
    header = lines[1]
    for label in ("output throughput (tok/s)", "request throughput (req/s)", "TTFT p99 (ms)", "TPOT median (ms)",
                  "goodput (req/s)", "makespan (s)", "prefill padding (tokens)"):
        assert label in header, header
    systems = [ln.split()[0] for ln in lines[3:6]]
    assert systems == ["flover/padded", "flover/packed", "sequential"], out
    assert "sequential *" in out and "* sequential: simulated from calibrated step times" in out
    assert "roofline: decode step of" in out and "…" not in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc == json.loads((tmp_path / "o" / "serve_bench.json").read_text())
    assert [r["system"] for r in doc["rows"]] == systems and doc["meta"]["engine"]["prefill"] == ["padded", "packed"]
    assert (tmp_path / "p.png").stat().st_size > 0 and (tmp_path / "o" / "serve_bench.png").stat().st_size > 0


def test_bench_unknown_system_is_a_usage_error_naming_the_flag(capsys):
    from hpdl.cli import main

    assert main(["serve", "bench", "--config", "llama-tiny", "--systems", "flover,vllm"]) != 0
    assert "--systems: a comma list among flover, sequential, static, cb, got 'flover,vllm'" in capsys.readouterr().err


def test_bench_takes_the_servers_own_served_model_name_flag():
    """``hpdl serve --served-model-name X`` and vLLM's bench spell it so; ``--served-model-name`` was unrecognized."""
    from hpdl.cli import build_parser

    p = build_parser()
    for flag in ("--served-model", "--served-model-name"):
        args = p.parse_args(["serve", "bench", "--url", "http://127.0.0.1:1", flag, "m"])
        assert args.served_model == "m"
