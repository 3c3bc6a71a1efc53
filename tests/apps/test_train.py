"""nanoGPT training: hpdl's gradient buckets, DDP with hpdl's hook and plain DDP give the same loss curve,
and the single-process run on the same global batches gives it too, up to float32 rounding.

On 2 ranks every communicator computes (g0 + g1) / 2 exactly (a + b == b + a; halving is exact), so their
curves must be bit-identical. The single process computes the gradient of the 4-row batch in one pass, a
different float32 summation order (relative 1e-7 per gradient element); AdamW's first steps move weights by
about lr * sign(g), so the loss curves agree to about 1e-5 (rtol 1e-4 leaves a margin; a wrong average or a
missing bucket changes the loss by 1e-2 or more).
"""

import sysconfig

import pytest
import torch

from hpdl.apps.train import TrainConfig, corpus_files, get_batch, load_corpus, lr_at, train
from hpdl.testing import get_pool

import _apps_cases as C

DATA = sysconfig.get_paths()["stdlib"] + "/typing.py"  # one standard-library file: a small local corpus
TINY = dict(steps=5, n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=2, learning_rate=3e-3,
            warmup_steps=2, data=DATA, log_interval=2, bucket_mb=0.02, first_bucket_mb=0.01)


@pytest.mark.timeout(300)
def test_loss_curves_equal_across_communicators_and_single_process():
    pool = get_pool(2)
    curves = {}
    for comm in ("nccl", "hpdl", "hpdl-ddp"):
        out = pool.run(C.train_run, dict(TINY, comm=comm))
        assert out[0][0] == out[1][0] and out[0][2] == 2
        curves[comm] = out[0][0]
        if comm == "hpdl":
            assert out[0][1] > 3  # several buckets, launched during backward
    assert curves["hpdl"] == curves["nccl"] == curves["hpdl-ddp"], curves
    single = train(TrainConfig(**dict(TINY, batch_size=4)), log=None)  # 1 x 4 rows = 2 ranks x 2 rows
    torch.testing.assert_close(torch.tensor(single["losses"]), torch.tensor(curves["nccl"]), rtol=1e-4, atol=0)
    assert curves["nccl"][-1] < curves["nccl"][0] - 0.3  # it learns
    # gradient accumulation: 2 micro-steps of 1 row per rank (the first under no_sync) = the same global batch
    acc = pool.run(C.train_run, dict(TINY, comm="hpdl", batch_size=1, grad_accum=2))
    torch.testing.assert_close(torch.tensor(acc[0][0]), torch.tensor(curves["hpdl"]), rtol=1e-4, atol=0)


def test_batches_schedule_and_corpus():
    data = load_corpus(DATA)
    assert data.dtype == torch.uint8 and len(data) > 10_000
    cfg = TrainConfig(**dict(TINY, grad_accum=2))
    whole = TrainConfig(**dict(TINY, batch_size=4, grad_accum=2))
    for m in range(2):
        x, y = get_batch(data, 3, m, whole, 1, 0, torch.device("cpu"))
        parts = [get_batch(data, 3, m, cfg, 2, r, torch.device("cpu")) for r in range(2)]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y[:, :-1], x[:, 1:])
    assert lr_at(0, cfg) == pytest.approx(cfg.learning_rate / 2)
    assert lr_at(cfg.steps - 1, cfg) == pytest.approx(cfg.min_lr)
    files = corpus_files()
    assert files and not any("site-packages" in f for f in files)
    with pytest.raises(ValueError, match=r"comm \(--comm\) must be one of"):
        TrainConfig(comm="gloo")
    with pytest.raises(ValueError, match=r"grad_accum \(--grad-accum\) must be an integer in \[1, "):
        TrainConfig(grad_accum=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"n_embd": 130, "n_head": 4}, r"n_embd \(--n-embd\) must be a multiple of n_head"),
    ({"learning_rate": -1}, r"learning_rate \(--learning-rate\) must be a finite number > 0"),
    ({"grad_clip": -3}, r"grad_clip \(--grad-clip\) must be a finite number >= 0"),
    ({"steps": "5"}, r"steps \(--steps\) must be an integer, got the str '5'"),
    ({"device": "tpu"}, r"device \(--device\) must be one of 'cpu', 'cuda', got 'tpu'")])
def test_config_from_python_is_checked_as_its_flags(kwargs, message):
    from hpdl.apps.cli import CGArgs
    from hpdl.runtime.errors import CLIUsageError

    with pytest.raises(CLIUsageError, match=message):
        TrainConfig(**kwargs)
    with pytest.raises(CLIUsageError, match=r"size \(--size\) must be an integer in \[2, 4096\], got 1"):
        CGArgs(size=1)
