"""hpdl.hpo: resource-aware distributed hyperparameter optimisation (HyperSack, seed abstract 4).

Optuna samplers and pruners choose and stop trials; a packing scheduler places several trials per GPU
where their profiled memory and compute shares fit; warm worker processes (or Ray tasks across nodes)
train, checkpoint and report; the Optuna RDB storage lets a killed study resume. See docs/hpo.md.

    >>> from hpdl.hpo import StudySpec, run_study          # doctest: +SKIP
    >>> run_study(StudySpec.from_yaml("study.yaml"))        # doctest: +SKIP
"""

from hpdl.hpo.errors import HpoConfigError, HpoError, Preempted
from hpdl.hpo.scheduler import (Assignment, Device, DeviceState, FixedFraction, OnePerGpu, Pack, PackHetero,
                                SchedulingPolicy, TrialDemand, get_policy)
from hpdl.hpo.spec import StudySpec

__all__ = ["Assignment", "Device", "DeviceState", "FixedFraction", "HpoConfigError", "HpoError", "OnePerGpu",
           "Pack", "PackHetero", "Preempted", "SchedulingPolicy", "StudySpec", "TrialDemand",
           "get_policy", "run_study", "study_status", "simulate"]


def __getattr__(name):  # heavy parts (torch, optuna) load on first use
    if name == "run_study":
        from hpdl.hpo.driver import run_study
        return run_study
    if name == "study_status":
        from hpdl.hpo.report import study_status
        return study_status
    if name == "simulate":
        from hpdl.hpo.simulator import simulate
        return simulate
    raise AttributeError(name)
