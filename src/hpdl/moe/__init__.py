"""hpdl.moe: ExFlow MoE inference (seed 5, arXiv 2401.08383).

Pure array functions (no processes): routing traces (:mod:`~hpdl.moe.trace`), inter-layer affinity
(:mod:`~hpdl.moe.affinity`), expert placement by integer programming (:mod:`~hpdl.moe.placement`), the
dispatch planner (:mod:`~hpdl.moe.dispatch`). A thin expert-parallel engine over torch.distributed
(:mod:`~hpdl.moe.engine`) runs the 2-Alltoall baseline and ExFlow's 1-Alltoall context-coherent mode.
"""

from hpdl.moe.errors import MoEError, PlacementError

__all__ = ["MoEError", "PlacementError"]
