"""Simulator: invariants, OOM behaviour of the naive policy, heterogeneity, CLI output (SIMULATION)."""

import argparse
import json

import pytest

from hpdl.hpo.cli import HpoCommand
from hpdl.hpo.errors import HpoConfigError
from hpdl.hpo.policies import GIB
from hpdl.hpo.simulator import SimTrial, pool_from_spec, simulate, synthetic_trials


def test_one_per_gpu_makespan_is_exact_for_serial_trials():
    trials = [SimTrial(k, 0.01, 0.005, GIB, 100, skey="a") for k in range(4)]
    r = simulate(trials, pool_from_spec("1xH100"), "one_per_gpu", startup_s=1.0)
    assert r.makespan_s == pytest.approx(4 * (1.0 + 100 * 0.01))
    r2 = simulate(trials, pool_from_spec("2xH100"), "one_per_gpu", startup_s=1.0)
    assert r2.makespan_s == pytest.approx(2 * (1.0 + 100 * 0.01))


def test_pack_colocates_launch_bound_trials_without_slowdown():
    trials = [SimTrial(k, 0.01, 0.001, GIB, 100, skey="a") for k in range(8)]
    one = simulate(trials, pool_from_spec("1xH100"), "one_per_gpu", startup_s=0.5)
    pack = simulate(trials, pool_from_spec("1xH100"), "pack", startup_s=0.5)
    assert pack.max_colocated >= 4 and one.makespan_s / pack.makespan_s > 3


def test_naive_fraction_runs_out_of_memory_where_pack_does_not():
    trials = [SimTrial(k, 0.01, 0.02, 30 * GIB, 50, skey=f"s{k % 2}", static_memory_bytes=40 * GIB)
              for k in range(8)]
    naive = simulate(trials, pool_from_spec("1xH100"), "fixed_fraction", fraction=0.125)
    pack = simulate(trials, pool_from_spec("1xH100"), "pack")
    assert naive.oom > 0 and pack.oom == 0 and pack.finished == naive.finished == 8


def test_hetero_pool_pack_hetero_not_slower_than_one_per_gpu():
    trials = synthetic_trials(48, seed=1)
    pool = pool_from_spec("3xA100,1xH100")
    base = simulate(trials, pool, "one_per_gpu").makespan_s
    assert simulate(trials, pool, "pack_hetero").makespan_s < base
    with pytest.raises(HpoConfigError, match="count"):
        pool_from_spec("twoxA100")


def test_cli_simulate_json(capsys, tmp_path):
    p = argparse.ArgumentParser()
    HpoCommand.add_arguments(p)
    args = p.parse_args(["simulate", "--pool", "2xA100,1xH100", "--format", "json", "--plot",
                         str(tmp_path / "s.png")])
    assert HpoCommand().run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulation"] is True and {r["policy"] for r in out["rows"]} >= {"pack", "one_per_gpu"}
    assert (tmp_path / "s.png").stat().st_size > 1000
    # --max-compute reaches the packing policies: a cap of one GPU's busy time packs no tighter than 8
    rows = {}
    for cap in ("1", "8"):
        args = p.parse_args(["simulate", "--pool", "1xH100", "--format", "json", "--mps", "--max-compute", cap,
                             "--policies", "pack"])
        assert HpoCommand().run(args) == 0
        rows[cap] = json.loads(capsys.readouterr().out)["rows"][0]
    assert rows["1"]["max_colocated"] < rows["8"]["max_colocated"]


def test_colocation_overhead_slows_packed_runs_only():
    trials = [SimTrial(k, 0.01, 0.001, GIB, 100, skey="a") for k in range(8)]
    pool = pool_from_spec("1xH100")
    assert simulate(trials, pool, "one_per_gpu", overhead=0.3).makespan_s == pytest.approx(
        simulate(trials, pool, "one_per_gpu").makespan_s)
    assert simulate(trials, pool, "pack", overhead=0.3).makespan_s > 1.3 * simulate(trials, pool, "pack").makespan_s


def test_mps_model_serves_busy_work_side_by_side_up_to_its_capacity():
    """Four trials of busy fraction 0.5 on one GPU: time-sliced they share 2 GPUs' worth of busy time on
    one (2x slower each); under MPS with capacity 2 they run at solo speed, with capacity 1 as time-sliced."""
    dev = pool_from_spec("1xH100")
    trials = [SimTrial(k, cpu_s=0.01, gpu_s=0.005, memory_bytes=GIB, steps=100) for k in range(4)]
    kw = dict(startup_s=0.0, lookahead=4, max_trials_per_device=4)
    sliced = simulate(trials, dev, "pack", max_compute=2.0, **kw).makespan_s
    mps = simulate(trials, dev, "pack", mps=True, mps_capacity=2.0, max_compute=2.0, **kw).makespan_s
    mps1 = simulate(trials, dev, "pack", mps=True, mps_capacity=1.0, max_compute=2.0, **kw).makespan_s
    assert mps == pytest.approx(1.0) and sliced == pytest.approx(2.0) and mps1 == pytest.approx(sliced)
    with pytest.raises(HpoConfigError, match="mps_capacity"):
        simulate(trials, dev, "pack", mps=True, mps_capacity=0)


def test_simulator_gives_policies_what_the_driver_gives():
    """Unprofiled trials reach the policy with their steps and the driver's placeholder run time (10 ms a
    step), not their true run time; each first profile reports its step time to ``observe``."""
    from hpdl.hpo.policies import Pack

    seen, observed = [], []

    class Recording(Pack):
        def place(self, pending, devices):
            seen.extend(pending)
            return super().place(pending, devices)

        def observe(self, compute, flops=0.0, memory_ratio=0.0, step_time_s=0.0):
            observed.append(step_time_s)
            super().observe(compute, flops, memory_ratio, step_time_s)

    trials = [SimTrial(k, 0.02, 0.004, GIB, 100 * (k + 1), skey=f"s{k}", flops=1e9 * (k + 1)) for k in range(3)]
    simulate(trials, pool_from_spec("1xH200"), Recording(max_trials_per_device=1))
    first = {t.key: t for t in reversed(seen) if not t.profiled}
    assert {k: (t.steps, t.work_s) for k, t in first.items()} == {k: (100 * (k + 1), (k + 1) * 1.0) for k in range(3)}
    assert observed == [pytest.approx(0.02)] * 3   # 20 ms a step: the placeholder is not the truth


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags,named", [
    (["--pool", "0xA100"], "--pool: pool spec part '0xA100': count 0"),  # spun at 100 % CPU forever
    (["--pool", "99999999xA100"], "--pool"),
    (["--trials-per-gpu", "100000000"], "--trials-per-gpu"),
    (["--overhead", "nan"], "--overhead"), (["--overhead", "inf"], "--overhead"), (["--overhead", "-1"], "--overhead"),
    (["--startup-s", "inf"], "--startup-s"), (["--startup-s", "1e300"], "--startup-s"),
    (["--mps", "--mps-capacity", "nan"], "--mps-capacity"), (["--max-compute", "nan"], "--max-compute"),
])
def test_cli_simulate_values_that_hung_are_usage_errors(flags, named, capsys):
    from hpdl.cli import main

    assert main(["hpo", "simulate", "--policies", "one_per_gpu,pack", *flags]) == 1
    err = capsys.readouterr().err
    # the subcommand's usage and help, where its flags are (before: `hpdl hpo`'s, which lists none of them)
    assert f"hpdl hpo simulate: error: {named}" in err and "usage: hpdl hpo simulate" in err, err
    assert "see hpdl hpo simulate --help" in err


def test_simulate_api_rejects_an_empty_pool_and_unbounded_numbers():
    trials = synthetic_trials(4)
    with pytest.raises(HpoConfigError, match="devices: the simulated pool is empty"):
        simulate(trials, [], "pack")
    with pytest.raises(HpoConfigError, match="overhead=inf"):
        simulate(trials, pool_from_spec("1xH100"), "pack", overhead=float("inf"))
