"""``hpdl bench attention`` on CPU at toy sizes: every suite runs, writes JSON and plots, and reports honestly."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hpdl.vision.bench import attention, crossover

torch.set_num_threads(1)


def test_crossover_is_where_soft_stays_faster():
    rows = [{"tokens": n, "method": m, "status": "ok", "fwd_bwd_ms": t}
            for n, s, d in ((256, 2.0, 1.0), (512, 0.9, 1.0), (1024, 1.1, 1.0), (2048, 1.0, 2.0), (4096, 1.0, 4.0))
            for m, t in (("soft", s), ("sdpa", d))]
    assert crossover(rows) == 2048  # 512 was faster once, but not from there on
    assert crossover([r for r in rows if r["tokens"] <= 1024 and r["tokens"] != 512]) is None


def test_methods_agree_where_they_should():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 8, generator=g) for _ in range(3))
    ref = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v
    torch.testing.assert_close(attention("sdpa", q, k, v, 16), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attention("softmax", q, k, v, 16), ref, rtol=1e-5, atol=1e-5)
    for method in ("soft", "soft_norm", "soft_inverse", "soft_autograd", "nystrom"):
        assert attention(method, q, k, v, 16).shape == v.shape
    with pytest.raises(ValueError, match="method"):
        attention("linear", q, k, v, 16)


def test_bench_attention_all_suites_on_cpu(tmp_path, capsys):
    pytest.importorskip("timm")
    from hpdl.cli import main

    rc = main(["bench", "attention", "--suite", "all", "--min-tokens", "64", "--max-tokens", "128",
               "--landmarks", "16", "--heads", "2", "--head-dim", "16", "--methods", "soft,soft_autograd,nystrom,sdpa,softmax",
               "--image-sizes", "64", "--model-batch", "1", "--models", "soft_tiny",
               "--baselines", "deit_tiny_patch16_224", "--image-size", "64", "--infer-batch", "1",
               "--train-batch", "2", "--warmup", "0", "--reps", "1", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "soft_bench.json").read_text())
    assert doc["meta"]["date"].endswith("UTC") and doc["meta"]["shape"].startswith("B=1 H=2 d=16")
    res = {suite: [r for r in doc["rows"] if r["suite"] == suite] for suite in ("tokens", "model", "throughput")}
    assert {(r["tokens"], r["method"]) for r in res["tokens"]} == {(n, m) for n in (64, 128)
                                                                   for m in ("soft", "soft_autograd", "nystrom", "sdpa", "softmax")}
    assert all(r["status"] == "ok" and r["fwd_bwd_ms"] > 0 for r in res["tokens"])
    assert [(r["attention"], r["stage1_tokens"], r["status"]) for r in res["model"]] == [
        ("soft", 256, "ok"), ("soft_inverse", 256, "ok"), ("sdpa", 256, "ok")]
    soft = next(r for r in res["throughput"] if r["model"] == "soft_tiny")
    assert soft["pair"] == "deit_tiny_patch16_224" and 0.1 < soft["gmacs"] < 0.3 and soft["train_images_per_s"] > 0
    assert {p.name for p in tmp_path.iterdir()} == {"soft_bench.json", "attention_tokens.png", "soft_model.png",
                                                    "throughput.png"}
    assert "soft faster than sdpa" in capsys.readouterr().out
    assert main(["bench", "attention", "--suite", "tokens,speed"]) == 2
    assert main(["bench", "attention", "-b", "512", "-e", "256"]) == 2   # nccl-tests' -b/-e, here in tokens
    assert main(["bench", "attention", "--suite", "model", "--model-attentions", "soft,fast"]) == 2


def test_flash_context_can_be_entered_many_times():
    """The benchmark enters the flash-only SDPA context once per timed call; sdpa_kernel's generator-based
    context manager can be entered only once, so the helper must hand out a fresh one each time."""
    import torch

    from hpdl.vision.timing import _sdpa_context

    ctx, label = _sdpa_context(torch.device("cuda"), torch.bfloat16)  # builds no CUDA state
    assert label == "flash"
    for _ in range(3):
        with ctx():
            pass


def test_goal_suite_layer_and_models_tables_on_cpu(tmp_path):
    """The goal suite's timing parts and report at toy sizes (its kernel check needs CUDA or the Triton
    interpreter: run ``TRITON_INTERPRET=1 hpdl bench attention --suite goal --smoke`` by hand, ~2 min here)."""
    pytest.importorskip("timm")
    from hpdl.vision.soft_goal import format_goal, plot_goal, run_layer, run_models

    cpu = torch.device("cpu")
    layer = run_layer(cpu, True, 0, 1)
    assert {(r["tokens"], r["method"]) for r in layer} == {(n, m) for n in (256, 1024)
                                                          for m in ("soft", "soft_newton20", "sdpa_flash")}
    assert all(r["status"] == "ok" and r["fwd_bwd_ms"] > 0 for r in layer)
    import time

    models = run_models(cpu, True, 0, 1, ["eager"], time.perf_counter() + 600)
    assert [(r["model"], r["status"]) for r in models] == [(n, "ok") for n in ("soft_tiny", "pvt_v2_b1",
                                                                              "soft_small", "pvt_v2_b2")]
    skipped = run_models(cpu, True, 0, 1, ["eager"], time.perf_counter() - 1)
    assert {r["status"] for r in skipped} == {"skipped"}
    result = {"meta": {"device_name": "cpu", "date": "now"}, "layer": layer, "models": models,
              "check": [{"check": "x", "case": "y", "rel_err": 2e-3, "tol": 1e-3, "ok": False, "gate": False}]}
    text = format_goal(result)
    assert "sdpa/soft" in text and "soft_tiny/pvt_v2_b1 eager: train" in text and "warn x" in text
    assert plot_goal(result, tmp_path) == "soft_goal.png" and (tmp_path / "soft_goal.png").stat().st_size > 0


def test_goal_suite_usage_errors():
    from hpdl.cli import main

    assert main(["bench", "attention", "--suite", "goal,tokens"]) == 2
    assert main(["bench", "attention", "--suite", "goal", "--goal-parts", "layer,fast"]) == 2
    assert main(["bench", "attention", "--suite", "goal", "--goal-pairs", "small,big"]) == 2
    assert main(["bench", "attention", "--suite", "goal", "--goal-pairs", "small,small"]) == 2
    if not os.environ.get("TRITON_INTERPRET"):
        assert main(["bench", "attention", "--suite", "goal"]) == 2   # CPU without the interpreter: no kernels


def test_goal_compile_blocks_compiles_each_block_and_keeps_outputs():
    """Regional compilation of the goal suite's compiled rows: every transformer block compiled in place
    (SOFT's SoftBlock and stage-4 Block), outputs unchanged (dynamo only: backend="eager")."""
    import torch._dynamo

    from hpdl.models.soft import SoftConfig, SoftViT
    from hpdl.vision.soft_goal import compile_blocks

    torch.manual_seed(0)
    model = SoftViT(SoftConfig(img_size=64, num_classes=3, embed_dims=(16, 32, 48, 64), num_heads=(2, 2, 3, 4),
                               depths=(1, 1, 1, 1), stem_channels=8)).eval()
    x = torch.randn(2, 3, 64, 64)
    ref = model(x)
    torch._dynamo.reset()
    assert compile_blocks(model, backend="eager") == 4
    assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl is not None for b in model.block2)
    assert torch.allclose(model(x), ref, atol=1e-6)


def test_goal_profile_step_and_its_report():
    from hpdl.vision.soft_goal import format_goal, profile_step

    a = torch.randn(64, 64)
    pr = profile_step(lambda: a @ a, calls=2)
    assert pr["host_ms"] > 0 and pr["kernels"] == (0 if not torch.cuda.is_available() else pr["kernels"])
    row = {"tokens": 4096, "method": "soft", "status": "ok", "landmarks": 64, "fwd_bwd_ms": 1.0, "peak_mib": 1.0,
           "nr_steps": 2, "profile": {"host_ms": 3.0, "device_ms": 1.5, "kernels": 90,
                                      "top": [{"kernel": "_rows_kernel", "ms": 0.5, "count": 3}]}}
    text = format_goal({"meta": {"device_name": "x"}, "layer": [row]})
    assert "host 3.00 ms to issue, device 1.50 ms in 90 kernels" in text and "_rows_kernel" in text
    assert "4096    64     2" in text   # tokens, landmarks, Newton steps


def test_goal_models_pairs_and_mode_order():
    """--goal-parts compiled,eager --goal-pairs small: the compiled soft_small/pvt_v2_b2 rows come first (a spent
    budget then skips eager rows, not them); rows say skipped once the budget is spent."""
    import time

    from hpdl.vision.soft_goal import PAIRS, run_models

    rows = run_models(torch.device("cpu"), True, 0, 1, ["compiled", "eager"], time.perf_counter() - 1, [PAIRS[1]])
    assert [(r["model"], r["mode"], r["status"]) for r in rows] == [
        ("soft_small", "compiled", "skipped"), ("pvt_v2_b2", "compiled", "skipped"),
        ("soft_small", "eager", "skipped"), ("pvt_v2_b2", "eager", "skipped")]


def test_goal_graphed_layer_table():
    """The CUDA-graphed columns (replay ms, graph MiB) beside the eager ratio, and a failed capture reported."""
    from hpdl.vision.soft_goal import format_goal

    def row(n, method, ms, gms=None, err=None):
        r = {"tokens": n, "method": method, "status": "ok", "landmarks": n // 64 if method != "sdpa_flash" else None,
             "fwd_bwd_ms": ms, "peak_mib": 1.0}
        if gms is not None:
            r.update(graph_ms=gms, graph_mib=5.0)
        if err:
            r["graph_error"] = err
        return r

    layer = [row(4096, "soft", 4.0, 0.5), row(4096, "soft_newton20", 5.0), row(4096, "sdpa_flash", 2.0, 2.0),
             row(16384, "soft", 8.0, err="RuntimeError: capture"), row(16384, "sdpa_flash", 6.0, 6.0)]
    text = format_goal({"meta": {"device_name": "x"}, "layer": layer})
    assert "captured in one CUDA graph" in text and "sdpa/soft > 1: SOFT faster" in text
    line4k = next(ln for ln in text.splitlines() if ln.strip().startswith("4096") and "(0.50x)" in ln)
    assert "4.00x" in line4k and "0.50" in line4k, line4k     # graphed 2.0 / 0.5 = 4x; eager 2 / 4 = 0.5x
    assert "graph soft at 16384 tokens: RuntimeError: capture" in text


def test_suites_and_goal_take_typed_options():
    """Issue 40: the suites' library functions take typed options, not the command line's Namespace."""
    from hpdl.vision.bench import TokensSuite, run_tokens
    from hpdl.vision.soft_goal import GoalOptions

    rows = run_tokens(TokensSuite(methods=["soft", "sdpa"], min_tokens=64, max_tokens=128, landmarks=16, warmup=0,
                                  reps=1), torch.device("cpu"), torch.float32)
    assert [(r["tokens"], r["method"], r["status"]) for r in rows] == [
        (64, "soft", "ok"), (64, "sdpa", "ok"), (128, "soft", "ok"), (128, "sdpa", "ok")]
    assert GoalOptions().pairs == ["tiny", "small"]
    for bad, words in ((dict(pairs=["small", "small"]), "pairs"), (dict(pairs=[]), "pairs"),
                       (dict(parts=["models"]), "parts"), (dict(time_budget=0), "time_budget")):
        with pytest.raises(ValueError, match=words):
            GoalOptions(**bad)
