"""hpdl.comm: collectives with the call shape of torch.distributed (seeds 1 and 2).

>>> import hpdl.comm as hc
>>> # inside an initialised process group:
>>> # hc.all_reduce(t, "sum", None, False, algorithm="direct")   # c10d order, then options
"""

from hpdl.comm.api import (CudaWork, Work, all_gather, all_gather_into_tensor, all_reduce, all_to_all_single,
                           barrier, broadcast, forget_group, reduce, reduce_scatter, reduce_scatter_tensor, reset,
                           set_topology)
from hpdl.comm.ops import REDUCE_OPS, SUPPORTED_DTYPES
from hpdl.comm.transport.worker import WorkerClosedError
from hpdl.comm.tuning import resolve

__all__ = ["CudaWork", "REDUCE_OPS", "SUPPORTED_DTYPES", "Work", "all_gather", "all_gather_into_tensor", "all_reduce",
           "all_to_all_single", "barrier", "broadcast", "forget_group", "reduce", "reduce_scatter",
           "reduce_scatter_tensor", "reset", "resolve", "set_topology", "WorkerClosedError"]
