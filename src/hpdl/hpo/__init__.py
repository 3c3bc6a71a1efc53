"""hpdl.hpo: resource-aware distributed hyperparameter optimisation (HyperSack, seed abstract 4).

Optuna samplers and pruners choose and stop trials; a packing scheduler places several trials per GPU
where their profiled memory and compute shares fit; warm worker processes (or Ray tasks across nodes)
train, checkpoint and report; the Optuna RDB storage lets a killed study resume. See docs/hpo.md.

    >>> from hpdl.hpo import StudySpec, run_study          # doctest: +SKIP
    >>> run_study(StudySpec.from_yaml("study.yaml"))        # doctest: +SKIP

An Optuna objective gets the same machinery with :func:`optimize` (see :mod:`hpdl.hpo.api`):

    >>> study = hpdl.hpo.optimize(objective, n_trials=64, gpus=2)   # doctest: +SKIP
"""

# Every name loads on first use: importing hpdl.hpo (e.g. hpdl.hpo._prestart, which the CLI runs before
# anything else) must not import torch, which hpdl.runtime imports.
_LAZY = {"HpoConfigError": "errors", "HpoError": "errors", "HpoInterrupted": "errors", "Preempted": "errors",
         "Assignment": "policies", "Device": "policies", "DeviceState": "policies", "FixedFraction": "policies",
         "OnePerGpu": "policies", "Pack": "policies", "PackHetero": "policies",
         "SchedulingPolicy": "policies", "TrialDemand": "policies", "get_policy": "policies",
         "StudySpec": "spec", "run_study": "driver", "StudyResult": "driver", "study_status": "report",
         "simulate": "simulator", "optimize": "api", "Workload": "workloads", "ObjectiveWorkload": "workloads",
         "TrialContext": "trial", "LocalTrial": "trial"}

__all__ = sorted(_LAZY)


def __dir__():
    # the names load lazily, so they are not module attributes yet: list them (dir(hpdl.hpo) was empty)
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'hpdl.hpo' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"hpdl.hpo.{_LAZY[name]}"), name)
