"""``hpdl.hpo.optimize``: hand over an Optuna objective, get hpdl's packing, fault tolerance and resume.

    import optuna
    import hpdl.hpo

    def objective(trial):                      # a plain Optuna objective, at module level
        lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        ...
        return val_loss

    if __name__ == "__main__":                 # worker processes import this file again
        study = hpdl.hpo.optimize(objective, n_trials=64, gpus=2)
        print(study.best_params)

It builds a study (:class:`hpdl.hpo.spec.StudySpec`) whose workload is the objective
(:class:`hpdl.hpo.workloads.ObjectiveWorkload`) and runs it with :func:`hpdl.hpo.run_study`: trials run in
warm worker processes placed by the packing policy, a worker that dies fails its trial (retried up to
``max_retries``), Ctrl-C stops every trial and leaves it WAITING, and calling ``optimize`` again with
``load_if_exists=True`` finishes the same budget.
"""

from __future__ import annotations

from typing import Any, Callable

from hpdl.hpo.errors import HpoConfigError, HpoError


def _pool(gpus) -> dict:
    if gpus is None:
        import torch

        return {"cuda": "all"} if torch.cuda.is_available() else {"fake": 1, "memory_gb": 4}
    if gpus == "all":
        return {"cuda": "all"}
    if isinstance(gpus, bool) or not isinstance(gpus, (int, list, tuple)):
        raise HpoConfigError(f"gpus={gpus!r}, expected None, 'all', a count >= 1 or a list of CUDA device ids")
    if isinstance(gpus, int):
        if gpus < 1:
            raise HpoConfigError(f"gpus={gpus}, expected a count >= 1 (or None: every GPU, one CPU device without)")
        return {"cuda": list(range(gpus))}
    if not gpus or not all(type(i) is int and i >= 0 for i in gpus):
        raise HpoConfigError(f"gpus={gpus!r}, expected a non-empty list of CUDA device ids")
    return {"cuda": list(gpus)}


def optimize(objective: Callable[[Any], float], *, n_trials: int, gpus: int | list[int] | str | None = None,
             study_name: str | None = None, storage: str | None = None, direction: str = "minimize",
             sampler: dict | str | None = None, pruner: dict | str | None = None, policy: str | dict = "pack",
             max_retries: int = 2, run_dir: str | None = None, load_if_exists: bool = False,
             pool: dict | None = None, timeout_s: float = 0.0, progress: bool = False):
    """Optimise ``objective(trial) -> float`` over ``n_trials`` configurations on a pool of GPUs.

    Args:
        objective: Optuna's define-by-run objective, a module-level function (worker processes import it;
            from a script, call ``optimize`` under ``if __name__ == "__main__":``). It uses ``trial.suggest_*``,
            ``trial.report``, ``trial.should_prune`` and may raise ``optuna.TrialPruned``, as with
            ``study.optimize``; it trains on ``torch.device("cuda")`` (each worker sees its one GPU as
            ``cuda:0``) or the CPU.
        n_trials: configurations to finish (completed or pruned; a configuration that failed
            ``max_retries + 1`` times is finished too). A retry does not count as a new configuration.
        gpus: ``None`` (default: every visible GPU, or one CPU device without any), ``"all"``, a count
            (the first N GPUs) or a list of CUDA ids.
        study_name: default: the objective's name. storage: SQLAlchemy URL; default: SQLite in ``run_dir``.
        direction: ``"minimize"`` (Optuna's default) or ``"maximize"``.
        sampler, pruner: ``{"name": "tpe", "seed": 0}``-style configurations or a name (``tpe``, ``random``,
            ``cmaes``, ...; ``median``, ``asha``, ... see docs/hpo.md); default: TPE with seed 0, no pruner.
            Each worker process reseeds its sampler, so parameters are not reproducible run to run.
        policy: placement policy (``pack`` default, ``one_per_gpu``, ``fixed_fraction``, ``pack_hetero``) or
            ``{"name": ..., **options}``.
        max_retries: retries of a configuration whose trial failed (an exception, a dead worker, OOM).
        run_dir: folder for the store, profiles and lock; default ``hpo-runs/<study_name>``.
        load_if_exists: continue a stored study of this name (as ``optuna.create_study(load_if_exists=True)``
            and ``hpdl hpo resume``): trials left WAITING or RUNNING by an interrupted run run again as
            themselves; without it an existing study is an error.
        pool: a raw pool configuration instead of ``gpus`` (e.g. ``{"fake": 2, "memory_gb": 4}`` on a CPU).
        timeout_s: stop with an error after this many seconds (0: no limit). progress: a live table.

    Returns:
        The ``optuna.Study``, loaded from the storage (``best_params``, ``best_value``, ``trials``, ...).

    Raises:
        HpoConfigError: an argument out of its range, named; HpoError: the study exists (without
            ``load_if_exists``) or the pool cannot start; HpoInterrupted: SIGINT/SIGTERM stopped it (every
            running trial is back to WAITING: call again with ``load_if_exists=True``).
    """
    import optuna

    from hpdl.hpo.driver import run_study
    from hpdl.hpo.spec import StudySpec, make_storage
    from hpdl.hpo.workloads import objective_ref

    if type(n_trials) is not int or n_trials < 1:
        raise HpoConfigError(f"n_trials={n_trials!r}, expected an int >= 1")
    if pool is not None and gpus is not None:
        raise HpoConfigError("give gpus or pool, not both")
    name = study_name or getattr(objective, "__name__", "objective")

    def conf(key, x, default):
        if x is None:
            return default
        if isinstance(x, str):
            return {"name": x}
        if not isinstance(x, dict):
            raise HpoConfigError(f"{key}={x!r}, expected a name or a mapping like {{'name': ..., **options}}")
        return dict(x)

    spec = StudySpec.from_dict({
        "study": name, "workload": objective_ref(objective), "n_trials": n_trials, "direction": direction,
        "sampler": conf("sampler", sampler, {"name": "tpe", "seed": 0}),
        "pruner": conf("pruner", pruner, {"name": "none"}), "policy": conf("policy", policy, {"name": "pack"}), "pool": pool if pool is not None else _pool(gpus),
        "max_retries": max_retries, "run_dir": run_dir or "", "storage": storage or "", "timeout_s": timeout_s,
        "checkpoint_every": 0})
    from hpdl.hpo.spec import sqlite_path

    resume = False
    db = sqlite_path(spec.storage)
    if db is None or db.exists():
        names = [s.study_name for s in optuna.get_all_study_summaries(make_storage(spec.storage))]
        resume = load_if_exists and spec.study in names
        if spec.study in names and not load_if_exists:
            # the driver's own message names CLI commands, which do not apply to an objective's study
            raise HpoError(f"study {spec.study!r} already exists in {spec.storage}; pass load_if_exists=True to "
                           "continue it, another study_name= to start a new one, or delete it first "
                           f"(optuna.delete_study(study_name={spec.study!r}, storage=...))")
    run_study(spec, resume=resume, progress=progress)
    return optuna.load_study(study_name=spec.study, storage=make_storage(spec.storage))
