"""Lineage accounting, retries and give-ups in the Optuna storage (in-memory study, no processes)."""

import optuna

from hpdl.hpo.ledger import Ledger


def study():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))


def rdb_study(tmp_path):
    """A study on SQLite, as the driver keeps them: Optuna's in-memory storage looks for WAITING trials only
    after the last one it popped, so it never sees a trial that went back to WAITING."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0),
                               storage=f"sqlite:///{tmp_path / 's.db'}")


def ask(s, ledger):
    t = s.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    t.set_user_attr("hpdl_lineage", t.user_attrs.get("hpdl_lineage", t.number))
    ledger.dirty = True
    return t


def test_failure_is_retried_with_same_params_until_max_retries_then_finished():
    s = study()
    lg = Ledger(s, max_retries=1, host="h")
    t0 = ask(s, lg)
    lg.fail(t0.number, t0.params, t0.user_attrs, "died", "boom")
    assert lg.lineages() == (set(), {0}) and lg.waiting == 1
    t1 = ask(s, lg)  # the enqueued retry
    assert t1.params == t0.params and t1.user_attrs["hpdl_attempt"] == 1 and t1.user_attrs["hpdl_lineage"] == 0
    lg.fail(t1.number, t1.params, t1.user_attrs, "oom", "boom")
    assert lg.lineages() == ({0}, set()) and lg.waiting == 0
    assert lg.failures == {"died": 1, "oom": 1}
    assert s.trials[1].user_attrs["hpdl_gave_up"] is True


def test_not_started_is_requeued_without_using_an_attempt_and_too_big_gives_up(tmp_path):
    s = rdb_study(tmp_path)
    lg = Ledger(s, max_retries=0, host="h")
    t0 = ask(s, lg)
    lg.fail(t0.number, t0.params, {**t0.user_attrs, "hpdl_attempt": -1}, "not_started", "driver died first")
    assert lg.lineages() == (set(), {0}) and lg.failures == {} and lg.waiting == 1
    assert s.trials[0].state.name == "WAITING"  # not FAIL: the same trial waits to run again (issue 37)
    t1 = ask(s, lg)
    assert t1.number == t0.number and t1.params == t0.params  # ask takes it again, with its parameters
    s.tell(t1, 0.5)
    lg.dirty = True
    t2 = ask(s, lg)
    lg.fail(t2.number, t2.params, t2.user_attrs, "too_big", "80 GiB", retry=False)
    assert lg.lineages() == ({0, 1}, set()) and len(s.trials) == 2


def test_asked_and_closed_keep_the_counts_a_reread_gives():
    """The driver counts its own asks and tells in memory; after every step the counts must equal a fresh
    read of the storage, through retries taken from the waiting queue, prunes and give-ups."""
    s = study()
    lg = Ledger(s, max_retries=1, host="h", refresh_s=3600)
    x = {"x": optuna.distributions.FloatDistribution(0, 1)}

    def check():
        mem = (set(lg.lineages()[0]), set(lg.lineages()[1]), lg.waiting)
        lg.dirty = True
        fresh = lg.lineages()
        assert mem == (fresh[0], fresh[1], lg.waiting)

    def ask_():
        lg.lineages()
        t = s.ask(x)
        lin = int(t.user_attrs.get("hpdl_lineage", t.number))
        if lin == t.number:
            t.set_user_attr("hpdl_lineage", lin)
        lg.asked(lin)
        check()
        return t, lin

    s.enqueue_trial({"x": 0.5})  # a user's enqueued configuration: waiting, its own lineage
    ts = [ask_() for _ in range(4)]
    assert lg.waiting == 0 and lg.lineages()[1] == {0, 1, 2, 3}
    s.tell(ts[0][0], 0.1)
    lg.closed(ts[0][1])
    check()
    s.tell(ts[1][0], state=optuna.trial.TrialState.PRUNED)
    lg.closed(ts[1][1])
    check()
    lg.fail(ts[2][0].number, ts[2][0].params, ts[2][0].user_attrs, "died", "boom")
    check()
    assert lg.waiting == 1
    retry, lin = ask_()  # popped from the waiting queue
    assert lin == 2 and lg.waiting == 0 and retry.params == ts[2][0].params
    s.tell(retry, 0.2)
    lg.closed(lin)
    check()
    assert lg.lineages() == ({0, 1, 2}, {3})


def test_trials_of_another_driver_on_the_same_storage_count_after_refresh_s():
    """Many nodes: two drivers share one study; each sees the other's new configurations within refresh_s."""
    import time

    s = study()
    mine, other = Ledger(s, 0, "a", refresh_s=0.2), Ledger(s, 0, "b", refresh_s=0.2)
    assert mine.lineages() == (set(), set())
    t = ask(s, other)
    assert mine.lineages() == (set(), set())  # within refresh_s: the last read
    time.sleep(0.25)
    assert mine.lineages() == (set(), {t.number})
    s.tell(t, 0.5)
    time.sleep(0.25)
    assert mine.lineages() == ({t.number}, set())


def test_recover_never_kills_a_process_that_got_a_dead_workers_pid_later(tmp_path):
    """A trial left RUNNING by a killed driver records its worker's pid; when a resume runs after that pid
    was reused by another Python process (started after the trial), the process is left alone (before:
    SIGKILLed, since any live Python process with the pid was taken for the worker)."""
    import subprocess
    import sys
    import time

    from hpdl.hpo.ledger import _is_our_worker

    s = study()
    lg = Ledger(s, max_retries=0, host="h")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for _ in range(100):  # until it has exec'd (its command line is empty before)
            with open(f"/proc/{other.pid}/cmdline", "rb") as f:
                if b"python" in f.read():
                    break
            time.sleep(0.05)
        t = ask(s, lg)
        for k, v in (("hpdl_host", "h"), ("hpdl_pid", other.pid), ("hpdl_started_at", time.time() - 3600)):
            t.set_user_attr(k, v)
        lg.recover()
        time.sleep(0.2)
        assert other.poll() is None, "recover killed a process that is not the trial's worker"
        assert not _is_our_worker(other.pid, time.time() - 3600)
        assert _is_our_worker(other.pid, time.time() + 5)  # started before the trial: a real worker
        assert s.trials[0].state.name == "WAITING" and lg.requeued == {"driver_died": 1}
    finally:
        other.kill()
        other.wait()


def test_interrupted_trials_wait_as_themselves_so_a_study_counts_one_trial_per_configuration(tmp_path):
    """Issue 37: after Ctrl-C and resume, 6 configurations showed as 12 trials, 6 of them FAIL. An
    interrupted trial now goes back to WAITING with its values and is asked again as itself."""
    s = rdb_study(tmp_path)
    lg = Ledger(s, max_retries=2, host="h")
    ts = [ask(s, lg) for _ in range(3)]
    ts[0].report(0.25, 10)
    for t in ts[:2]:
        lg.fail(t.number, t.params, t.user_attrs, "interrupted", "the driver stopped")
    assert [t.state.name for t in s.trials] == ["WAITING", "WAITING", "RUNNING"]
    assert lg.requeued == {"interrupted": 2} and lg.failures == {}
    again = [ask(s, lg) for _ in range(2)]
    assert sorted(t.number for t in again) == [0, 1]
    for t in again + [ts[2]]:
        s.tell(t, 0.5)
    trials = s.get_trials()
    assert len(trials) == 3 and {t.state.name for t in trials} == {"COMPLETE"}
    assert trials[0].intermediate_values == {10: 0.25}
    assert trials[0].user_attrs["hpdl_requeued"] == ["interrupted: the driver stopped"]
    lg.dirty = True
    assert lg.lineages() == ({0, 1, 2}, set())
