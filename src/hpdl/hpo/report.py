"""Study status from storage, and the plot of best value against wall time per policy."""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from hpdl.hpo.errors import HpoError


def study_status(storage: str, study: str) -> dict[str, Any]:
    """Counts by trial state, best value and parameters, and the trials now running with their device.

    Raises:
        HpoError: no study named ``study`` in ``storage``.
    """
    import optuna

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
    lineages = {int(t.user_attrs.get("hpdl_lineage", t.number)) for t in trials
                if t.state.name in ("COMPLETE", "PRUNED")}
    return {"study": study, "direction": s.direction.name.lower(), "n_trials": spec.get("n_trials"),
            "finished_configs": len(lineages), "states": dict(counts),
            "best_value": best.value if best else None, "best_params": dict(best.params) if best else None,
            "running": [{"number": t.number, "device": t.user_attrs.get("hpdl_device"),
                         "host": t.user_attrs.get("hpdl_host"), "last_step": t.last_step}
                        for t in trials if t.state.name == "RUNNING"],
            "failures": [{"number": t.number, "reason": t.user_attrs.get("hpdl_failure", "")[:120]}
                         for t in trials if t.state.name == "FAIL"]}


def plot_best_vs_time(curves: dict[str, Sequence[tuple[float, float]]], path: str, title: str,
                      ylabel: str = "best value") -> str:
    """Step plot of best-so-far value (y) against wall time in seconds (x), one line per policy; PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, pts in curves.items():
        if pts:
            xs, ys = zip(*pts)
            ax.step(xs, ys, where="post", label=name, marker=".")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
