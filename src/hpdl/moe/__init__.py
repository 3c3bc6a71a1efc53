"""hpdl.moe: ExFlow MoE inference (seed 5, arXiv 2401.08383).

Pure array functions (no processes): routing traces (:mod:`~hpdl.moe.trace`), inter-layer affinity
(:mod:`~hpdl.moe.affinity`), expert placement by integer programming (:mod:`~hpdl.moe.placement`), the
dispatch planner (:mod:`~hpdl.moe.dispatch`, host and device) and grouped expert GEMMs (:mod:`~hpdl.moe.grouped`).
A thin, device-generic expert-parallel engine over hpdl.comm (:mod:`~hpdl.moe.engine`) runs the 2-Alltoall
baseline and ExFlow's 1-Alltoall context-coherent mode on CPU or CUDA tensors.
"""

from hpdl.moe.errors import MoEError, PlacementError

__all__ = ["MoEError", "PlacementError"]
