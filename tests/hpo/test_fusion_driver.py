"""Fused groups in a real study (2 fake CPU devices), group formation and sizing, the fusion options of the
study file, and the simulator's fusion model."""

import math

import optuna
import pytest
import torch

from hpdl.hpo.driver import run_study
from hpdl.hpo.errors import HpoConfigError
from hpdl.hpo.grouping import FuseOptions, form_groups, group_skey, largest_group, parse_group_skey, scale_profile
from hpdl.hpo.simulator import SimTrial, fuse_trials, pool_from_spec, simulate, synthetic_trials
from hpdl.hpo.spec import StudySpec, make_storage
from hpdl.hpo.trial import LocalTrial
from hpdl.hpo.workloads import VisionCNN, get_workload

FIXED = {"depth": 1, "width": 8, "batch_size": 16, "image_size": 8, "steps": 30, "eval_every": 10,
         "val_size": 128}


Ctx = LocalTrial  # the trial alone, in memory
# wait_s 60: the asks fill every group at once (lookahead >= n_trials), so the wait never runs out here; a short
# one let a loaded machine start a trial before its group was complete (a verdict depending on load)


@pytest.mark.timeout(180)
def test_fused_study_values_equal_lone_trials(tmp_path):
    """8 configurations of one shape (own lr, momentum, weight decay, warm-up, seed) fused 4 at a time on 2
    fake devices: every trial completes, ran fused, and reports what it reports trained alone."""
    spec = StudySpec.from_dict({
        "study": "fz", "workload": "cnn", "n_trials": 8, "run_dir": str(tmp_path / "run"),
        "sampler": {"name": "random", "seed": 3},
        "space": {"lr": {"type": "float", "low": 0.02, "high": 0.2, "log": True},
                  "momentum": {"type": "float", "low": 0.5, "high": 0.9},
                  "weight_decay": {"type": "categorical", "choices": [0.0, 0.001]},
                  "warmup_steps": {"type": "categorical", "choices": [0, 10]},
                  "seed": {"type": "int", "low": 0, "high": 3}},
        "fixed": FIXED, "pool": {"fake": 2, "memory_gb": 2}, "lookahead": 8,
        "policy": {"name": "pack", "max_trials_per_device": 1}, "fuse": {"max_trials": 4, "wait_s": 60.0}})
    res = run_study(spec)
    assert res.complete == 8 and not res.failures
    trials = optuna.load_study(study_name="fz", storage=make_storage(spec.storage)).get_trials()
    assert all(t.user_attrs.get("hpdl_fused", 1) >= 2 for t in trials)
    torch.set_num_threads(1)
    w = get_workload("cnn")
    for t in trials:
        alone = Ctx({**FIXED, **t.params})
        value = w.train(alone)
        assert sorted(t.intermediate_values) == [10, 20, 30]
        assert t.value == pytest.approx(value, abs=1.01 / FIXED["val_size"])  # one image of 128 at most


@pytest.mark.timeout(180)
def test_pruned_trials_leave_their_group_and_the_others_finish_as_alone(tmp_path):
    """GPT trials fused 3 at a time; the threshold pruner stops those with the tiny learning rate at step 10,
    which leave their group, while the others in it finish with the values they have alone."""
    gpt = {"n_embd": 32, "n_layer": 1, "n_head": 2, "block_size": 16, "batch_size": 8, "steps": 20,
           "eval_every": 10, "val_batches": 2}
    spec = StudySpec.from_dict({
        "study": "pr", "workload": "gpt", "n_trials": 6, "run_dir": str(tmp_path / "run"),
        "sampler": {"name": "random", "seed": 0},
        "space": {"lr": {"type": "categorical", "choices": [1e-6, 1e-2]},
                  "seed": {"type": "int", "low": 0, "high": 5}},
        "pruner": {"name": "threshold", "upper": 5.0}, "fixed": gpt, "pool": {"fake": 2, "memory_gb": 2},
        "lookahead": 6, "policy": {"name": "pack", "max_trials_per_device": 1},
        "fuse": {"max_trials": 3, "wait_s": 60.0}})
    res = run_study(spec)
    trials = optuna.load_study(study_name="pr", storage=make_storage(spec.storage)).get_trials()
    assert res.complete + res.pruned == 6 and not res.failures
    assert all(t.user_attrs.get("hpdl_fused") == 3 for t in trials)
    slow = [t for t in trials if t.params["lr"] == 1e-6]
    fast = [t for t in trials if t.params["lr"] == 1e-2]
    assert slow and fast  # the seed samples both
    assert all(t.state.name == "PRUNED" and sorted(t.intermediate_values) == [10] for t in slow)
    torch.set_num_threads(1)
    w = get_workload("gpt")
    for t in fast:
        assert t.state.name == "COMPLETE" and sorted(t.intermediate_values) == [10, 20]
        assert t.value == pytest.approx(w.train(Ctx({**gpt, **t.params})), rel=1e-5)


@pytest.mark.timeout(180)
def test_same_shape_asks_batch_a_mixed_space(tmp_path):
    """With same_shape_asks, TPE's asks come in batches of one shape (width), each fused as one group."""
    spec = StudySpec.from_dict({
        "study": "mixed", "workload": "cnn", "n_trials": 6, "run_dir": str(tmp_path / "run"),
        "sampler": {"name": "tpe", "seed": 1},
        "space": {"lr": {"type": "float", "low": 0.02, "high": 0.2, "log": True},
                  "width": {"type": "categorical", "choices": [4, 8, 12, 16]}},
        "fixed": {**{k: v for k, v in FIXED.items() if k != "width"}, "steps": 10, "eval_every": 5},
        "pool": {"fake": 2, "memory_gb": 2}, "lookahead": 6,
        "policy": {"name": "pack", "max_trials_per_device": 1},
        "fuse": {"max_trials": 3, "wait_s": 60.0, "same_shape_asks": True}})
    res = run_study(spec)
    assert res.complete == 6
    trials = sorted(optuna.load_study(study_name="mixed", storage=make_storage(spec.storage)).get_trials(),
                    key=lambda t: t.number)
    widths = [t.params["width"] for t in trials]
    assert widths[0] == widths[1] == widths[2] and widths[3] == widths[4] == widths[5]
    assert len({t.params["lr"] for t in trials}) == 6  # the sampler still chose every learning rate
    assert all(t.user_attrs.get("hpdl_fused") == 3 for t in trials)


class T:
    def __init__(self, key, since=0.0):
        self.key, self.since = key, since


def test_form_groups_fills_holds_and_limits():
    ts = [T("a"), T("b"), T("a"), T("a"), T("b"), T("a"), T("a", since=9.5)]
    groups = form_groups(ts, lambda t: t.key, 4, wait_s=1.0, filling=False, now=10.0)
    assert [[ts.index(x) for x in g] for g in groups] == [[0, 2, 3, 5], [1, 4], [6]]
    # while the sampler still asks, a partial group waits (unless its oldest trial waited wait_s)
    held = form_groups(ts, lambda t: t.key, 4, wait_s=1.0, filling=True, now=10.0)
    assert [[ts.index(x) for x in g] for g in held] == [[0, 2, 3, 5], [1, 4]]
    assert form_groups(ts, lambda t: t.key, 4, 1.0, False, 10.0, limit=lambda t: 2)[0] == [ts[0], ts[2]]


def test_fuse_options_and_keys():
    assert FuseOptions.parse(False) is None and FuseOptions.parse(None) is None
    assert FuseOptions.parse(True) == FuseOptions(16, 0.5, False)
    assert FuseOptions.parse({"same_shape_asks": True}).same_shape_asks
    assert FuseOptions.parse({"max_trials": 8}) == FuseOptions(8, 0.5)
    for bad, word in (({"max_trials": 1}, "max_trials"), ({"wait_s": -1}, "wait_s"), ({"k": 2}, "unknown"),
                      ({"same_shape_asks": "yes"}, "same_shape_asks"),
                      ("yes", "expected false")):
        with pytest.raises(HpoConfigError, match=word):
            FuseOptions.parse(bad)
    assert parse_group_skey(group_skey("cnn:width=8", 4)) == (4, "cnn:width=8")
    assert parse_group_skey("cnn:width=8") == (1, "cnn:width=8")
    gib = 1 << 30
    assert largest_group(2 * gib, 10 * gib, gib) == 9


def test_scale_profile_model():
    gib = 1 << 30
    # launch-bound: 10 ms host, 2 ms GPU per step; 4 fused: the same host time, 8 ms GPU
    mem, step, comp = scale_profile(2 * gib, 0.010, 0.2, 1, 4, gib)
    assert mem == 5 * gib and step == pytest.approx(0.010) and comp == pytest.approx(0.8)
    mem, step, comp = scale_profile(5 * gib, 0.010, 0.8, 4, 8, gib)
    assert mem == 9 * gib and step == pytest.approx(0.016) and comp == pytest.approx(1.0)
    assert math.isnan(scale_profile(gib, float("nan"), float("nan"), 1, 2, 0)[1])


class NotFusable(VisionCNN):
    name = "not_fusable"
    fuse_vary = ()


def test_spec_fuse_key(tmp_path):
    base = {"study": "s", "workload": "cnn", "run_dir": str(tmp_path), "space": {}, "pool": {"fake": 1}}
    assert StudySpec.from_dict({**base, "fuse": {"max_trials": 4}}).fuse == {"max_trials": 4}
    with pytest.raises(HpoConfigError, match="max_trials"):
        StudySpec.from_dict({**base, "fuse": {"max_trials": 0}})
    with pytest.raises(HpoConfigError, match="cannot be fused"):
        StudySpec.from_dict({**base, "workload": "test_fusion_driver:NotFusable", "fuse": True})


def test_group_demand_scaled_from_the_nearest_profiled_size():
    from hpdl.hpo.placement import group_profiles
    from hpdl.hpo.profiler import CONTEXT_BYTES, ProfileCache, TrialProfile

    profiles, gib = ProfileCache(), 1 << 30
    skey = group_skey("cnn:w=8", 8)
    measured = lambda: group_profiles(profiles, skey, {"H200"}, CONTEXT_BYTES)  # noqa: E731
    assert measured() == []  # nothing measured: the static bound is used
    profiles.put("cnn:w=8", TrialProfile("H200", CONTEXT_BYTES + gib // 8, 0.010, 0.1, 1e9, "cuda"))
    (one,) = measured()  # from a lone trial: 8 x its memory beyond the context
    assert one.memory_bytes == CONTEXT_BYTES + gib and one.step_time_s == pytest.approx(0.010)
    assert one.compute == pytest.approx(0.8) and one.flops == pytest.approx(8e9)
    profiles.put(group_skey("cnn:w=8", 4), TrialProfile("H200", CONTEXT_BYTES + gib, 0.012, 0.5, 4e9, "cuda"))
    (four,) = measured()  # the nearest size, 4, wins over 1
    assert four.memory_bytes == CONTEXT_BYTES + 2 * gib and four.compute == pytest.approx(1.0)
    own = TrialProfile("H200", 3 * gib, 0.02, 0.9, 8e9, "cuda")
    profiles.put(skey, own)
    assert measured() == [own]  # measured for its own size: as it is


def test_simulator_fusion_model():
    gib = 1 << 30
    trials = [SimTrial(k, 0.01, 0.001, 2 * gib, 100, value=k, skey="s", static_memory_bytes=3 * gib) for k in range(8)]
    groups = fuse_trials(trials, 4, context_bytes=gib)
    assert [g.key for g in groups] == [0, 4] and groups[0].value == 3 and groups[0].skey == "fused4|s"
    assert groups[0].memory_bytes == 5 * gib and groups[0].gpu_s == pytest.approx(0.004)
    pool = pool_from_spec("1xH200")
    alone = simulate(trials, pool, "one_per_gpu", startup_s=0.0)
    fused = simulate(trials, pool, "one_per_gpu", startup_s=0.0, fuse=4)
    assert fused.finished == alone.finished == 8
    assert fused.makespan_s == pytest.approx(alone.makespan_s / 4)  # launch-bound: 4 trials for the host time of one


def test_simulator_fusion_groups_fit_the_largest_device():
    # as the driver (grouping.largest_group): a group holds no more trials than fit in the largest GPU's
    # memory; before, `hpdl hpo simulate --policies pack+fuse --fuse 16` (docs/hpo.md) failed with
    # "trial 32 fits on no device of the pool" on the synthetic trace
    gib = 1 << 30
    trials = [SimTrial(k, 0.01, 0.001, 11 * gib, 100, value=k, skey="s", static_memory_bytes=12 * gib)
              for k in range(16)]
    groups = fuse_trials(trials, 16, context_bytes=gib, device_bytes=80 * gib)
    assert [int(g.skey.split("|")[0][5:]) for g in groups] == [7, 7, 2]  # 1 + 7 x 11 GiB <= 80 GiB
    assert all(max(g.memory_bytes, g.static_memory_bytes) <= 80 * gib for g in groups)
    res = simulate(trials, pool_from_spec("2xA100"), "pack", startup_s=0.0, fuse=16)
    assert res.finished == 16
    synthetic = synthetic_trials(64)
    for pool in ("12xA100,4xH100", "2xH200"):
        assert simulate(synthetic, pool_from_spec(pool), "pack", startup_s=0.05, fuse=16).finished == 64
