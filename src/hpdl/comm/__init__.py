"""hpdl.comm: collectives with the call shape of torch.distributed (seeds 1 and 2).

>>> import hpdl.comm as hc
>>> # inside an initialised process group:
>>> # hc.all_reduce(t, op="sum", algorithm="direct")
"""

from hpdl.comm.api import (Work, all_gather, all_reduce, all_to_all_single, forget_group, reduce_scatter, reset,
                           set_topology)
from hpdl.comm.ops import REDUCE_OPS, SUPPORTED_DTYPES

__all__ = ["REDUCE_OPS", "SUPPORTED_DTYPES", "Work", "all_gather", "all_reduce", "all_to_all_single", "forget_group",
           "reduce_scatter", "reset", "set_topology"]
