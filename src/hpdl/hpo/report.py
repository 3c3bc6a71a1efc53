"""Study status from storage, and the plot of best value against wall time per policy."""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from hpdl.hpo.errors import HpoError


def _reason(failure: str) -> str:
    """``"<kind>: <message>"`` cut to its kind and the message's last non-empty line (a traceback's last
    line is the exception itself; its first, "Traceback (most recent call last):", says nothing)."""
    kind, _, msg = str(failure).partition(": ")
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return f"{kind}: {last[:300]}" if last else kind


def study_status(storage: str, study: str) -> dict[str, Any]:
    """Counts by trial state, best value and parameters, the trials now running with their device, and the
    failed ones with their reason (``failures``: the trial's own, each spent an attempt; ``requeued``: stopped
    by an interrupt, a driver's death or the run folder and put back to WAITING, no attempt spent). A RUNNING
    trial that no worker has started yet has ``host``, ``device`` and ``last_step`` None. Counts configurations as the driver does (:class:`hpdl.hpo.ledger.Ledger`:
    a configuration given up after its retries is finished). A RUNNING trial of a driver on this host
    whose heartbeat is gone (killed) is listed under ``orphaned``, not ``running``: ``resume`` re-queues it.

    Raises:
        HpoError: no study named ``study`` in ``storage``.
    """
    import socket

    import optuna

    from hpdl.hpo.ledger import Ledger, counts_as_attempt
    from hpdl.hpo.lock import live_drivers
    from hpdl.hpo.spec import make_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    st = make_storage(storage)
    if study not in [s.study_name for s in optuna.get_all_study_summaries(st)]:
        raise HpoError(f"study {study!r} not found in {storage}")
    s = optuna.load_study(study_name=study, storage=st)
    trials = s.get_trials(deepcopy=False)
    counts = Counter(t.state.name for t in trials)
    done = [t for t in trials if t.state.name == "COMPLETE"]
    best = None
    if done:
        best = (max if s.direction.name == "MAXIMIZE" else min)(done, key=lambda t: t.value)
    spec = s.user_attrs.get("hpdl_spec", {})
    finished, _ = Ledger(s, int(spec.get("max_retries", 2)), socket.gethostname(), storage=st).lineages()
    live_hosts = {d["host"] for d in live_drivers(s.user_attrs)}
    me = socket.gethostname()
    fails = [t for t in trials if t.state.name == "FAIL"]
    running, orphaned = [], []
    for t in trials:
        if t.state.name != "RUNNING":
            continue
        host = t.user_attrs.get("hpdl_host")
        row = {"number": t.number, "device": t.user_attrs.get("hpdl_device"), "host": host, "last_step": t.last_step}
        # only this host's drivers can be checked (pid and heartbeat); another host's trial is taken as live
        (orphaned if (host in (me, None) and me not in live_hosts) else running).append(row)
    return {"study": study, "direction": s.direction.name.lower(), "n_trials": spec.get("n_trials"),
            "finished_configs": len(finished), "states": dict(counts),
            "best_value": best.value if best else None, "best_params": dict(best.params) if best else None,
            "live_drivers": sorted(live_hosts), "running": running, "orphaned": orphaned,
            "failures": [{"number": t.number, "reason": _reason(t.user_attrs.get("hpdl_failure", ""))}
                         for t in fails if counts_as_attempt(t.user_attrs.get("hpdl_failure", ""))],
            # stopped for a reason not their own and put back to WAITING (the same trial runs again, no attempt
            # spent); stores written before 2026-12-04 hold such trials as FAIL with a re-queued copy
            "requeued": [{"number": t.number, "state": t.state.name,
                          "reason": _reason(t.user_attrs["hpdl_requeued"][-1])}
                         for t in trials if t.user_attrs.get("hpdl_requeued")]
            + [{"number": t.number, "state": t.state.name, "reason": _reason(t.user_attrs.get("hpdl_failure", ""))}
               for t in fails if not counts_as_attempt(t.user_attrs.get("hpdl_failure", ""))]}


def plot_best_vs_time(curves: dict[str, Sequence[tuple[float, float]]], path: str, title: str,
                      ylabel: str = "best value", ends: dict[str, float] | None = None) -> str:
    """Step plot of best-so-far value (y) against wall time in seconds (x), one line per policy; PNG.

    ``ends`` (seconds per policy, e.g. simulated makespans): each line runs on to its policy's end, marked
    with an ``x``, and the x-axis covers the latest end (a line that stopped at its last improvement made
    the policy that finished last look like the fastest)."""
    import matplotlib.pyplot as plt

    fig = best_vs_time_figure(curves, title, ylabel, ends)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def best_vs_time_figure(curves: dict[str, Sequence[tuple[float, float]]], title: str, ylabel: str = "best value",
                        ends: dict[str, float] | None = None):
    """The figure of :func:`plot_best_vs_time` (a ``matplotlib.figure.Figure``, Agg backend)."""
    from hpdl.bench.common import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ends = ends or {}
    for name, pts in curves.items():
        if pts:
            xs, ys = map(list, zip(*pts))
            end = ends.get(name)
            if end is not None and end > xs[-1]:
                xs.append(end)
                ys.append(ys[-1])
            line, = ax.step(xs, ys, where="post", label=name if end is None else f"{name} (ends {end:.0f} s)",
                            marker=".")
            if end is not None:
                ax.plot([end], [ys[-1]], marker="x", markersize=9, color=line.get_color())
    if ends:
        ax.set_xlim(0, max(ends.values()) * 1.03)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig
