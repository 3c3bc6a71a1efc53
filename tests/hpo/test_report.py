"""`hpdl hpo status` and the simulate plot, on stores and curves built directly (no workers)."""

import argparse
import socket

import optuna
import pytest

from hpdl.hpo.cli import HpoCommand
from hpdl.hpo.report import best_vs_time_figure, study_status
from hpdl.hpo.spec import make_storage

TB = ('error: Traceback (most recent call last):\n  File "w.py", line 3, in train\n    raise ValueError("lr")\n'
      'ValueError: lr=3.0 diverged at step 40\n')


def _study(tmp_path, db="s.db"):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{tmp_path}/{db}"
    s = optuna.create_study(study_name="s", storage=make_storage(url), direction="maximize")
    s.set_user_attr("hpdl_spec", {"n_trials": 3, "max_retries": 0})
    t = s.ask()  # configuration 0: failed once, max_retries 0 -> given up: finished
    t.set_user_attr("hpdl_failure", TB)
    t.set_user_attr("hpdl_gave_up", True)
    s.tell(t, state=optuna.trial.TrialState.FAIL)
    t = s.ask()  # configuration 1: complete
    s.tell(t, 0.5)
    t = s.ask()  # configuration 2: its driver was killed (no heartbeat of this host)
    t.set_user_attr("hpdl_host", socket.gethostname())
    t.set_user_attr("hpdl_device", "fake:0")
    t.report(0.3, 20)
    return url


def test_status_counts_given_up_configurations_shows_the_exception_and_orphans(tmp_path, capsys):
    st = study_status(_study(tmp_path), "s")
    assert st["finished_configs"] == 2  # the given-up configuration is finished, as the driver counts it
    assert st["failures"] == [{"number": 0, "reason": "error: ValueError: lr=3.0 diverged at step 40"}]
    assert st["running"] == [] and [r["number"] for r in st["orphaned"]] == [2]
    parser = argparse.ArgumentParser()
    HpoCommand.add_arguments(parser)
    HpoCommand().run(parser.parse_args(["status", "--storage", f"sqlite:///{tmp_path}/s.db", "--study", "s"]))
    out = capsys.readouterr().out
    assert "2/3 configurations finished" in out and "driver died" in out and "running trial" not in out


def test_status_lists_interrupted_trials_apart_from_failures(tmp_path, capsys):
    url = _study(tmp_path)
    s = optuna.load_study(study_name="s", storage=make_storage(url))
    t = s.ask()  # a Ctrl-C stopped it: stored FAIL, configuration re-queued, no attempt spent
    t.set_user_attr("hpdl_failure", "interrupted: the driver stopped; checkpointed and re-queued")
    s.tell(t, state=optuna.trial.TrialState.FAIL)
    st = study_status(url, "s")
    assert [r["number"] for r in st["failures"]] == [0] and [r["number"] for r in st["requeued"]] == [3]
    parser = argparse.ArgumentParser()
    HpoCommand.add_arguments(parser)
    HpoCommand().run(parser.parse_args(["status", "--storage", url, "--study", "s"]))
    out = capsys.readouterr().out
    assert "failed trial 3" not in out and "re-queued without spending an attempt" in out and "trials 3" in out


def test_a_trial_of_a_live_driver_is_running(tmp_path):
    import os
    import time

    url = _study(tmp_path)
    s = optuna.load_study(study_name="s", storage=make_storage(url))
    s.set_user_attr(f"hpdl_driver@{socket.gethostname()}", {"pid": os.getpid(), "beat_at": time.time()})
    st = study_status(url, "s")
    assert [r["number"] for r in st["running"]] == [2] and st["orphaned"] == []


def test_simulate_plot_covers_every_makespan():
    """The x-axis stopped at the last improvement (near 8 s) while makespans were 17-66 s."""
    fig = best_vs_time_figure({"one_per_gpu": [(1.0, 0.5), (8.0, 0.9)], "pack": [(0.5, 0.6), (3.0, 0.95)]}, "t",
                              ends={"one_per_gpu": 66.0, "pack": 17.0})
    ax = fig.axes[0]
    assert ax.get_xlim()[1] >= 66.0
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert lines["pack (ends 17 s)"].get_xdata()[-1] == pytest.approx(17.0)
    assert lines["one_per_gpu (ends 66 s)"].get_xdata()[-1] == pytest.approx(66.0)


def test_hpo_help_texts_show_defaults(capsys):
    parser = argparse.ArgumentParser()
    HpoCommand.add_arguments(parser)
    for cmd in ("run", "status", "simulate"):
        with pytest.raises(SystemExit):
            parser.parse_args([cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: table)" in text and "(default: None)" not in text
    assert "(default: 12xA100,4xH100)" in text and "--plot PNG" in text


def test_live_table_shows_the_studys_best_and_its_last_frame_is_forced(tmp_path):
    """The table's best is the study's (a resumed study's earlier trials included), and the final frame is
    drawn whatever the refresh limit (its last frame said best 0.6074 where the final line said 0.9785)."""
    import time

    from hpdl.hpo.driver import Driver
    from hpdl.hpo.progress import Progress
    from hpdl.hpo.spec import StudySpec
    from test_driver import spec_dict

    drv = Driver(StudySpec.from_dict(spec_dict(tmp_path)))
    try:
        drv._prior_best, drv.history = 0.9785, [(1.0, 0.6074)]
        view = Progress(drv)
        assert "best 0.9785" in view._table().title
        drv.history.append((2.0, 0.99))
        drawn = []
        inner = view.live.update
        view.live.update = lambda table, **kw: (drawn.append(table.title), inner(table, **kw))
        view._last = time.monotonic()  # just drawn: a plain update skips this frame
        view.update()
        assert drawn == []
        view.update(force=True)
        assert len(drawn) == 1 and "best 0.99" in drawn[0]
        view.close()
    finally:
        drv.shutdown()


def test_status_reads_the_store_of_a_study_run_with_run_dir(tmp_path, capsys):
    """`hpdl hpo run study.yaml --run-dir R` then `hpdl hpo status study.yaml --run-dir R` (before: "unrecognized
    arguments: --run-dir"; without it the study file's run_dir was read, another store)."""
    import yaml

    run = tmp_path / "R"
    run.mkdir()
    _study(run, "study.db")
    f = tmp_path / "study.yaml"
    f.write_text(yaml.safe_dump({"study": "s", "run_dir": str(tmp_path / "elsewhere"),
                                 "space": {"lr": {"type": "float", "low": 0.01, "high": 0.1}}}))
    parser = argparse.ArgumentParser()
    HpoCommand.add_arguments(parser)
    for argv in (["status", str(f), "--run-dir", str(run)], ["status", "--run-dir", str(run), "--study", "s"]):
        assert HpoCommand().run(parser.parse_args(argv)) == 0
        assert "2/3 configurations finished" in capsys.readouterr().out


def test_status_of_a_trial_no_worker_started_names_it_so(tmp_path, capsys):
    """Issue 37: a trial asked but not yet started printed "running on None/None at step None"."""
    url = _study(tmp_path)
    s = optuna.load_study(study_name="s", storage=make_storage(url))
    s.ask()  # trial 3: asked by a live driver, no worker has taken it yet
    parser = argparse.ArgumentParser()
    HpoCommand.add_arguments(parser)
    HpoCommand().run(parser.parse_args(["status", "--storage", url, "--study", "s"]))
    out = capsys.readouterr().out
    assert "None" not in out and "trial 3" in out and "(asked, not yet started on a worker)" in out, out
    assert "trial 2 was running on " in out and "at step 20" in out


def test_status_lists_trials_requeued_as_waiting(tmp_path, capsys):
    url = _study(tmp_path)
    st = make_storage(url)
    s = optuna.load_study(study_name="s", storage=st)
    from hpdl.hpo.ledger import Ledger

    t = s.ask()
    Ledger(s, 0, "h", storage=st).requeue(t.number, "interrupted", "the driver stopped; checkpointed")
    rep = study_status(url, "s")
    assert rep["requeued"] == [{"number": 3, "state": "WAITING", "reason": "interrupted: the driver stopped; "
                                                                          "checkpointed"}]
    assert rep["states"].get("FAIL") == 1 and rep["failures"][0]["number"] == 0
