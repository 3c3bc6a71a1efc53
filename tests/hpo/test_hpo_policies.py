"""Placement policies against fake GPU pools (pure CPU, no processes)."""

import random

import pytest

from hpdl.hpo.errors import HpoConfigError
from hpdl.hpo.policies import (GIB, Device, DeviceState, FixedFraction, OnePerGpu, Pack, PackHetero,
                                TrialDemand, check_placement, get_policy)


def pool(n=2, mem_gb=10, speeds=None):
    speeds = speeds or [1.0] * n
    return [Device(f"g{i}", "A" if s < 1 else "H", int(mem_gb * GIB), s) for i, s in enumerate(speeds)]


def apply(policy, pending, states):
    """Place, then move the placed demands onto the device states (as the driver does)."""
    by_key = {t.key: t for t in pending}
    out = policy.place(pending, states)
    by_dev = {s.device.id: s for s in states}
    for a in out:
        by_dev[a.device_id].running.append(by_key[a.key])
    keys = [a.key for a in out]
    assert len(keys) == len(set(keys)), "a trial placed twice in one call"
    return out


@pytest.mark.parametrize("name", ["pack", "pack_hetero"])
def test_memory_never_exceeded_random_pools(name):
    rng = random.Random(0)
    for _ in range(300):
        devices = [Device(f"g{i}", "k", int(rng.uniform(1, 40) * GIB), rng.choice([0.5, 1.0, 2.0]))
                   for i in range(rng.randint(1, 5))]
        states = [DeviceState(d) for d in devices]
        policy = get_policy(name)
        next_key = 0
        for _round in range(6):
            pending = [TrialDemand(next_key + j, int(rng.uniform(0.05, 45) * GIB), rng.uniform(0.02, 1.0),
                                   rng.uniform(1, 100), profiled=rng.random() < 0.7) for j in range(rng.randint(0, 8))]
            next_key += len(pending)
            apply(policy, pending, states)
            check_placement(states)
            for s in states:  # some trials end or are pruned between rounds
                s.running = [t for t in s.running if rng.random() < 0.6]


def test_one_per_gpu_places_one_per_free_device_fifo():
    states = [DeviceState(d) for d in pool(3)]
    states[1].running.append(TrialDemand(99, GIB))
    out = OnePerGpu().place([TrialDemand(k, GIB) for k in range(5)], states)
    assert [(a.key, a.device_id) for a in out] == [(0, "g0"), (1, "g2")]


def test_fixed_fraction_ignores_memory_and_caps_slots():
    states = [DeviceState(d) for d in pool(1, mem_gb=10)]
    out = FixedFraction(0.25).place([TrialDemand(k, 6 * GIB) for k in range(6)], states)
    assert len(out) == 4  # floor(1/0.25) slots, 24 GiB on a 10 GiB device: the naive policy over-commits
    for a in out:
        states[0].running.append(TrialDemand(a.key, 6 * GIB))
    with pytest.raises(AssertionError, match="capacity"):
        check_placement(states)


def test_pack_colocates_light_trials_and_respects_compute_gain():
    states = [DeviceState(d) for d in pool(1, mem_gb=80)]
    light = [TrialDemand(k, GIB, compute=0.15, profiled=True) for k in range(20)]
    out = apply(Pack(max_compute=1.0), light, states)
    # co-locate while the device still has idle compute: 7 x 0.15 = 1.05 >= 1 stops it
    assert len(out) == 7
    heavy = TrialDemand(50, GIB, compute=0.95, profiled=True)
    assert Pack(max_compute=1.0).place([heavy], states) == []


def test_pack_default_oversubscribes_light_trials_to_the_calibrated_cap():
    states = [DeviceState(d) for d in pool(1, mem_gb=80)]
    light = [TrialDemand(k, GIB, compute=0.15, profiled=True) for k in range(20)]
    out = apply(Pack(max_trials_per_device=32), light, states)
    assert len(out) == 14   # 14 x 0.15 = 2.1 >= 2.0 (the default max_compute) stops it
    assert Pack(max_trials_per_device=32).place([TrialDemand(50, GIB, compute=0.3, profiled=True)], states) == []


def test_pack_heavy_trials_keep_the_one_gpu_cap():
    """A GPU-bound trial never joins a device past a summed busy fraction of 1, and a device running one
    takes light trials only up to 1 (heavy trials thrash when stacked: 10-12x slower on the H200)."""
    states = [DeviceState(d) for d in pool(1, mem_gb=80)]
    p = Pack(max_trials_per_device=32)
    light = [TrialDemand(k, GIB, compute=0.15, profiled=True) for k in range(7)]
    apply(p, light, states)                                                   # sum 1.05
    assert p.place([TrialDemand(50, GIB, compute=0.6, profiled=True)], states) == []
    states = [DeviceState(d) for d in pool(1, mem_gb=80)]
    apply(p, [TrialDemand(60, GIB, compute=0.6, profiled=True)], states)     # a heavy trial alone
    more = [TrialDemand(k, GIB, compute=0.15, profiled=True) for k in range(10)]
    assert len(p.place(more, states)) == 2                                    # 0.6 + 2 x 0.15 = 0.9 <= 1
    states = [DeviceState(d) for d in pool(1, mem_gb=80)]
    two = [TrialDemand(70, GIB, compute=0.95, profiled=True), TrialDemand(71, GIB, compute=0.95, profiled=True)]
    assert len(p.place(two, states)) == 1                                     # 1.9 would exceed one GPU
    with pytest.raises(HpoConfigError, match="light_below"):
        Pack(light_below=0)


def test_pack_first_wave_before_any_profile_keeps_the_one_gpu_cap():
    """Unprofiled trials (0.25 guessed) may be heavy: until a profile exists they fill one GPU's worth only."""
    states = [DeviceState(d) for d in pool(1, mem_gb=80)]
    new = [TrialDemand(k, GIB, profiled=False) for k in range(10)]
    assert len(Pack(max_trials_per_device=32).place(new, states)) == 4


def test_pack_heavy_memory_goes_alone_and_light_fill_elsewhere():
    states = [DeviceState(d) for d in pool(2, mem_gb=20)]
    pending = [TrialDemand(0, 18 * GIB, 0.5, profiled=True)] + [TrialDemand(k, 3 * GIB, 0.1, profiled=True)
                                                               for k in range(1, 6)]
    apply(Pack(), pending, states)
    check_placement(states)
    heavy_dev = next(s for s in states if any(t.key == 0 for t in s.running))
    assert heavy_dev.memory_used <= 20 * GIB and len(heavy_dev.running) == 1


def test_repack_after_prune_starts_waiting_trial():
    states = [DeviceState(d) for d in pool(1, mem_gb=10)]
    apply(Pack(), [TrialDemand(0, 6 * GIB, 0.3, profiled=True)], states)
    waiting = [TrialDemand(1, 6 * GIB, 0.3, profiled=True)]
    assert Pack().place(waiting, states) == []  # does not fit next to trial 0
    states[0].running.clear()                    # trial 0 pruned
    assert [a.key for a in Pack().place(waiting, states)] == [1]


def test_pack_hetero_sends_long_trial_to_fast_gpu_and_short_to_slow():
    states = [DeviceState(d) for d in pool(2, mem_gb=40, speeds=[0.5, 2.0])]
    pending = [TrialDemand(0, GIB, 0.9, work_s=5, profiled=True), TrialDemand(1, GIB, 0.9, work_s=500, profiled=True)]
    out = {a.key: a.device_id for a in PackHetero().place(pending, states)}
    assert out[1] == "g1"  # the fast GPU
    assert out[0] == "g0"


def test_starving_trial_reserves_a_device():
    states = [DeviceState(d) for d in pool(1, mem_gb=10)]
    states[0].running.append(TrialDemand(0, 5 * GIB, 0.2, profiled=True))
    big = TrialDemand(1, 8 * GIB, 0.5, waited_s=100, profiled=True)
    small = TrialDemand(2, 1 * GIB, 0.1, profiled=True)
    assert Pack(starve_after_s=30).place([big, small], states) == []  # small must not jump the starving trial
    assert [a.key for a in Pack(starve_after_s=1000).place([big, small], states)] == [2]


def test_mps_share_and_errors():
    states = [DeviceState(d) for d in pool(1)]
    assert Pack(mps=True).place([TrialDemand(0, GIB, 0.3, profiled=True)], states)[0].sm_percent == 100
    a = Pack(mps=True, sm_caps=True, max_compute=1.0).place([TrialDemand(0, GIB, 0.3, profiled=True)], states)[0]
    assert a.sm_percent == 30
    a = Pack(mps=True, sm_caps=True).place([TrialDemand(0, GIB, 0.3, profiled=True)], states)[0]
    assert a.sm_percent == 4    # SM shares split the GPU in proportion to max_compute (8 under MPS): sum <= 100
    assert Pack(sm_caps=True).place([TrialDemand(0, GIB, 0.3, profiled=True)], states)[0].sm_percent == 100
    with pytest.raises(HpoConfigError, match="expected one of"):
        get_policy("nope")
    with pytest.raises(HpoConfigError, match="fraction"):
        FixedFraction(0)
    with pytest.raises(HpoConfigError, match="memory_bytes"):
        Device("x", "k", 0)


def test_unprofiled_bound_over_every_device_tries_largest_empty_device_alone():
    devices = [Device("small", "A", 10 * GIB), Device("big", "H", 20 * GIB)]
    states = [DeviceState(d) for d in devices]
    over = TrialDemand(0, 30 * GIB, profiled=False)
    assert [(a.key, a.device_id) for a in Pack().place([over], states)] == [(0, "big")]
    states[1].running.append(TrialDemand(9, GIB, 0.1, profiled=True))
    assert Pack().place([over], states) == []  # never next to another trial
    assert Pack().place([TrialDemand(1, 30 * GIB, 0.5, profiled=True)], [DeviceState(d) for d in devices]) == []


def test_idle_worker_entries_hold_memory_but_are_not_trials():
    states = [DeviceState(d) for d in pool(1, mem_gb=10)]
    states[0].running += [TrialDemand(-1 - i, GIB, 0.0, profiled=True) for i in range(16)][:4]
    assert [a.key for a in OnePerGpu().place([TrialDemand(0, GIB)], states)] == [0]
    assert [a.key for a in Pack(max_trials_per_device=1).place([TrialDemand(0, GIB, 0.2, profiled=True)],
                                                             states)] == [0]
    assert Pack().place([TrialDemand(1, 7 * GIB, 0.2, profiled=True)], states) == []  # 4 GiB held by idle workers


def test_pack_hetero_migrates_promising_trial_to_free_fast_gpu_only():
    slow, fast = pool(2, mem_gb=40, speeds=[0.5, 2.0])
    hot = TrialDemand(0, GIB, 0.5, work_s=100, priority=1.0, profiled=True)
    cold = TrialDemand(1, GIB, 0.5, work_s=100, priority=0.0, profiled=True)
    short = TrialDemand(2, GIB, 0.2, work_s=1, priority=1.0, profiled=True)
    states = [DeviceState(slow, [hot, cold, short]), DeviceState(fast)]
    assert PackHetero().migrations(states) == [0]      # one per target GPU per call, the promising long one
    busy = DeviceState(fast, [TrialDemand(9, GIB, 1.0, profiled=True), TrialDemand(8, GIB, 1.0, profiled=True)])
    assert PackHetero().migrations([states[0], busy]) == []  # no idle compute on the fast GPU
    full = DeviceState(Device("f", "H", 2 * GIB, 2.0), [TrialDemand(9, int(1.5 * GIB), 0.1, profiled=True)])
    assert PackHetero().migrations([states[0], full]) == []  # does not fit in memory


def test_unprofiled_share_follows_the_measured_median():
    states = [DeviceState(d) for d in pool(1, mem_gb=80)]
    new = [TrialDemand(k, GIB, profiled=False) for k in range(8)]
    p = Pack(max_compute=1.0)   # the rule, at a cap of one GPU
    assert len(p.place(new, states)) == 4  # 0.25 each before any profile
    for c in (1.0, 1.0, 0.9):
        p.observe(c)                          # a GPU-bound study: unknown trials now count as a full GPU
    assert len(p.place(new, states)) == 1


def test_unprofiled_share_follows_the_profiled_configuration_nearest_in_flops():
    """Launch-bound small trials and a GPU-bound large one in one study: an unprofiled trial borrows the
    share measured for the configuration of similar FLOPs, not the study median."""
    states = [DeviceState(d) for d in pool(1, mem_gb=80)]
    p = Pack(max_trials_per_device=32, max_compute=1.0)
    p.observe(0.1, flops=1e9)
    p.observe(0.12, flops=2e9)
    p.observe(1.0, flops=1e12)
    small = [TrialDemand(k, GIB, profiled=False, flops=1.5e9) for k in range(20)]
    assert len(p.place(small, states)) == 9     # 0.12 each: nine fit under a summed share of 1
    big = [TrialDemand(k, GIB, profiled=False, flops=3e12) for k in range(4)]
    assert len(p.place(big, states)) == 1       # counted as a full GPU
    assert p.max_concurrency() == 32 and Pack().max_concurrency() == 16


def test_mps_detection_needs_a_live_daemon_not_just_its_pipe(tmp_path):
    import os
    import subprocess
    import sys

    from hpdl.hpo.policies import mps_active
    assert not mps_active(str(tmp_path))
    (tmp_path / "control").touch()
    assert not mps_active(str(tmp_path))        # a pipe left by a killed daemon
    (tmp_path / "nvidia-cuda-mps-control.pid").write_text(f"{os.getpid()}\n")
    assert mps_active(str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "nvidia-cuda-mps-control.pid").write_text(dead.stdout)
    assert not mps_active(str(tmp_path))
    with pytest.raises(HpoConfigError, match="mps"):
        Pack(mps="yes")


@pytest.mark.parametrize("mps", [False, True])
def test_heavy_trials_share_with_light_ones_only_under_mps(mps):
    """Time-slicing: a GPU-bound trial next to light ones thrashes, so it runs alone. MPS: kernels of the
    processes run side by side, so it joins them up to ``max_compute``."""
    states = [DeviceState(d) for d in pool(1, mem_gb=80)]
    states[0].running += [TrialDemand(k, GIB, 0.15, profiled=True) for k in range(4)]   # load 0.6
    heavy = TrialDemand(9, GIB, 1.0, profiled=True)
    assert Pack(mps=mps).max_compute == (8.0 if mps else 2.0)
    fresh = [DeviceState(d) for d in pool(1, mem_gb=80)]
    # before any profile, large unknown trials get one GPU's worth (0.25 each); small ones fill a GPU under MPS
    big = [TrialDemand(k, 3 * GIB, 1.0, profiled=False) for k in range(8)]
    assert len(Pack(mps=mps, max_trials_per_device=15).place(big, fresh)) == 4
    many = [TrialDemand(k, GIB, 1.0, profiled=False) for k in range(20)]
    assert len(Pack(mps=mps, max_trials_per_device=15).place(many, fresh)) == (15 if mps else 4)
    p = Pack(mps=mps, max_trials_per_device=15, max_compute=2.0)
    assert [a.key for a in p.place([heavy], states)] == ([9] if mps else [])
    states = [DeviceState(d, [TrialDemand(9, GIB, 1.0, profiled=True)]) for d in pool(1, mem_gb=80)]
    light = [TrialDemand(k, GIB, 0.15, profiled=True) for k in range(10)]
    assert len(p.place(light, states)) == (7 if mps else 0)  # load 1.0 + 7 x 0.15 passes 2.0 with the 7th
    # a heavy trial joins only within the cap, MPS or not (joining while the load is under it, as light
    # trials do, was measured and not kept: docs/benchmarks/hpo.md)
    busy = [DeviceState(d, [TrialDemand(k, GIB, 0.35, profiled=True) for k in range(10)]) for d in pool(1, mem_gb=80)]
    assert Pack(mps=mps, max_compute=4.0).place([heavy], busy) == []                     # 3.5 + 1.0 > 4.0


@pytest.mark.parametrize("mps", [False, True])
def test_before_any_profile_only_small_trials_fill_a_gpu_and_only_under_mps(mps):
    """Static bounds of at most SMALL_BYTES cannot exhaust a GPU when wrong, so under MPS such trials need not
    wait for the first profile; one byte more and they get one GPU's worth (0.25 each), as without MPS."""
    from hpdl.hpo.policies import SMALL_BYTES

    fresh = [DeviceState(d) for d in pool(1, mem_gb=80)]
    small = [TrialDemand(k, SMALL_BYTES, 1.0, profiled=False) for k in range(20)]
    over = [TrialDemand(k, SMALL_BYTES + 1, 1.0, profiled=False) for k in range(20)]
    p = Pack(mps=mps, max_trials_per_device=15)
    assert len(p.place(small, fresh)) == (15 if mps else 4)
    assert len(p.place(over, fresh)) == 4


def test_migration_counts_scaled_bounds_and_the_trial_cap():
    """A migration target must have room as place() counts it: unprofiled neighbours at their scaled static
    bound, and fewer trials than the per-device cap."""
    fast = Device("fast", "H100", 80 * GIB, speed=2.0)
    slow = Device("slow", "A100", 80 * GIB, speed=1.0)
    mover = TrialDemand(1, 10 * GIB, 0.2, work_s=100.0, priority=1.0, profiled=True)
    p = PackHetero(migrate_min_s=1.0)
    p.observe(0.2, 1e9, memory_ratio=2.0)
    neighbour = TrialDemand(2, 39 * GIB, 0.2, profiled=False)          # 78 GiB once scaled
    states = [DeviceState(slow, [mover]), DeviceState(fast, [neighbour])]
    # place() would not put it next to 78 GiB either: 78 + 10 > 80
    assert [(a.key, a.device_id) for a in p.place([mover], [DeviceState(slow), states[1]])] == [(1, "slow")]
    assert p.migrations(states) == []
    states = [DeviceState(slow, [mover]), DeviceState(fast, [TrialDemand(2, GIB, 0.01, profiled=True)])]
    assert p.migrations(states) == [1]
    capped = PackHetero(migrate_min_s=1.0, max_trials_per_device=1)
    assert capped.migrations(states) == []


def test_static_bounds_grow_by_the_largest_measured_over_static_ratio():
    """Measured peaks of large-batch CNNs exceeded their static bound by up to 1.7x: once a profile shows
    that, unprofiled bounds are scaled by it (profiled demands are not)."""
    states = [DeviceState(d, [TrialDemand(9, 40 * GIB, 0.2, profiled=True)]) for d in pool(1, mem_gb=80)]
    unknown = TrialDemand(1, 30 * GIB, profiled=False)
    p = Pack()
    assert [a.key for a in p.place([unknown], states)] == [1]      # 40 + 30 <= 80
    p.observe(0.9, 1e12, memory_ratio=1.7)
    assert p.place([unknown], states) == []                         # 40 + 51 > 80
    assert [a.key for a in p.place([TrialDemand(2, 30 * GIB, 0.2, profiled=True)], states)] == [2]
    p.observe(0.1, 1e9, memory_ratio=1.2)                           # the largest ratio is kept
    assert p.place([unknown], states) == []


def test_pack_caps_planned_memory_of_large_trials_only():
    dev = pool(1, mem_gb=40)[0]
    pol = Pack()
    assert pol.memory_cap(TrialDemand(0, GIB, 0.5, 1.0, profiled=True), dev) is None
    assert pol.memory_cap(TrialDemand(1, 6 * GIB, 0.5, 1.0, profiled=True), dev) == 6 * GIB
    pol.observe(0.5, memory_ratio=1.5)  # unprofiled bounds are planned scaled: the cap is that plan
    assert pol.memory_cap(TrialDemand(2, 6 * GIB, 1.0, 1.0), dev) == 9 * GIB
    assert pol.memory_cap(TrialDemand(3, 60 * GIB, 1.0, 1.0), dev) is None  # over the device: tried alone
    assert Pack(memory_caps=False).memory_cap(TrialDemand(1, 6 * GIB, 0.5, 1.0, profiled=True), dev) is None
    for baseline in (OnePerGpu(), FixedFraction(0.125)):
        assert baseline.memory_cap(TrialDemand(1, 6 * GIB, 0.5, 1.0, profiled=True), dev) is None


def test_pack_order_longest_starts_the_longest_estimated_trial_first():
    """``order="longest"`` (LPT): with room for one trial, the longest estimated solo run goes first, not the
    largest in memory; an unprofiled trial is estimated from its steps and the nearest profiled step time,
    scaled by the FLOPs ratio (a 32x larger batch of 10 steps outlasts 600 launch-bound steps)."""
    dev = pool(1, mem_gb=80)
    big_short = TrialDemand(0, 8 * GIB, 1.0, work_s=0.5, profiled=True)
    small_long = TrialDemand(1, GIB, 1.0, work_s=3.0, profiled=True)
    for order, first in (("memory", 0), ("longest", 1)):
        p = Pack(max_trials_per_device=1, order=order)
        assert [a.key for a in p.place([big_short, small_long], [DeviceState(d) for d in dev])] == [first]
    p = Pack(max_trials_per_device=1, order="longest")
    p.observe(1.0, flops=1e9, step_time_s=0.002)     # launch-bound: 2 ms a step
    p.observe(1.0, flops=1e12, step_time_s=0.006)    # the large-batch neighbour: 6 ms a step
    light = TrialDemand(2, GIB, work_s=6.0, flops=1e9, steps=600)       # 600 x 2 ms = 1.2 s
    heavy = TrialDemand(3, GIB, work_s=0.1, flops=32e12, steps=10)      # 10 x 6 ms x 32 = 1.92 s
    tiny = TrialDemand(4, GIB, work_s=9.0, flops=1e8, steps=100)        # floor: 100 x 2 ms = 0.2 s
    assert p._work(light) == pytest.approx(1.2) and p._work(heavy) == pytest.approx(1.92)
    assert p._work(tiny) == pytest.approx(0.2)
    assert [a.key for a in p.place([light, heavy, tiny], [DeviceState(d) for d in dev])] == [3]
    with pytest.raises(HpoConfigError, match="order"):
        Pack(order="fifo")


@pytest.mark.parametrize("order", ["memory", "longest"])
def test_starving_trial_goes_first_once_its_reserved_device_drained(order):
    """A starving large trial reserves a GPU; once enough has finished there it starts before the long light
    trials that come earlier in the order (under LPT they would take the drained GPU again, forever)."""
    dev = pool(1, mem_gb=80)[0]
    p = Pack(max_trials_per_device=16, order=order)
    big = TrialDemand(0, 60 * GIB, 0.5, work_s=0.5, profiled=True, waited_s=p.starve_after_s + 1)
    lights = [TrialDemand(k, 4 * GIB, 0.01, work_s=5.0, profiled=True) for k in range(1, 40)]
    full = DeviceState(dev, lights[:16])                 # 64 GiB used: the big trial does not fit
    assert p.place([big] + lights[16:], [full]) == []    # reserved: nothing else starts there
    drained = DeviceState(dev, lights[:4])               # 16 GiB used: it fits now
    out = p.place(lights[16:] + [big], [drained])
    assert out[0].key == 0 and Pack().order == "longest"


def test_pack_hetero_scores_an_unprofiled_trial_by_its_estimated_run_time():
    """``pack_hetero`` sends a trial to the GPU where it finishes first using the same estimate it orders by:
    an unprofiled large-batch trial (placeholder 0.1 s, estimated 1.92 s) goes to the busy fast GPU, not to
    the idle one at 0.4x speed."""
    fast, slow = Device("fast", "H100", 80 * GIB, 1.0), Device("slow", "A100", 80 * GIB, 0.4)
    p = PackHetero(mps=True)
    p.observe(1.0, flops=1e12, step_time_s=0.006)
    heavy = TrialDemand(3, GIB, work_s=0.1, flops=32e12, steps=10)
    busy = TrialDemand(9, GIB, compute=0.5, work_s=1.0, profiled=True)
    assert p._work(heavy) == pytest.approx(1.92)
    assert [a.device_id for a in p.place([heavy], [DeviceState(fast, [busy]), DeviceState(slow)])] == ["fast"]


@pytest.mark.parametrize("kw,name", [({"unprofiled_compute": 0}, "unprofiled_compute"),
                                     ({"unprofiled_compute": -1}, "unprofiled_compute"),
                                     ({"unprofiled_compute": float("nan")}, "unprofiled_compute"),
                                     ({"starve_after_s": -5}, "starve_after_s"),
                                     ({"starve_after_s": float("nan")}, "starve_after_s")])
def test_pack_refuses_shares_and_waits_out_of_range(kw, name):
    # unprofiled_compute 0 (or nan) packed unprofiled trials up to the memory limit; a nan wait never starved
    with pytest.raises(HpoConfigError, match=name):
        Pack(**kw)
