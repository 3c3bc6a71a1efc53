"""Executors hide process topology from the engine: one process, or tensor-parallel over torch.distributed.

``TPExecutor`` runs its ranks on :class:`hpdl.runtime.WorkerGroup`: the engine's process is rank 0 (the
group's driver) and ranks 1..world-1 each hold a :class:`_TPRank` service. Every step, rank 0 posts the plan (a
small picklable object) to the workers over the group's typed channel (pipes written synchronously by the
caller), then all ranks run the same forward, whose collectives (NCCL on GPU, gloo on CPU) join them. Only rank
0 samples; the next plan carries the sampled tokens, so every rank sees the same inputs (vLLM v0's driver-worker
shape).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from hpdl.runtime.launch import WorkerGroup
from hpdl.serve.scheduler import StepPlan
from hpdl.serve.worker import ModelRunner, ModelSpec, build_model


@dataclasses.dataclass
class RunnerArgs:
    num_slots: int
    max_seq_len: int
    device: str = "cpu"
    cuda_graph: bool = False
    tp_all_reduce: str = "nccl"
    fused_decode: bool | None = None
    ranks_per_gpu: int | None = None   # TP ranks sharing one GPU (None: HPDL_RANKS_PER_GPU); see TPExecutor
    fused_gemm: str = "cublas"


class UniprocExecutor:
    """Model and KV cache in this process.

    ``retry_safe``: a forward that raised may be run again, one request at a time, to find the request at
    fault (nothing else shares its state). A tensor-parallel forward may not: the other ranks could be left
    inside a collective, so any exception there is an engine fault.
    """

    retry_safe = True

    def __init__(self, spec: ModelSpec, args: RunnerArgs):
        model = build_model(spec, args.device)
        self.runner = ModelRunner(model, args.num_slots, args.max_seq_len, 1, args.cuda_graph,
                                  fused=args.fused_decode, fused_gemm=args.fused_gemm)
        self.config = model.cfg

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        pass


class _TPRank:
    """A worker rank's service (ranks 1..world-1 of a :class:`TPExecutor`, on :class:`hpdl.runtime.WorkerGroup`):
    its model shard and runner, built once; each call runs one step's plan. Returns nothing: only rank 0 samples."""

    def __init__(self, ctx, spec: ModelSpec, args: RunnerArgs):
        if os.environ.get("HPDL_SERVE_FAULTHANDLER"):  # debugging hangs: dump every thread's stack later
            import faulthandler

            faulthandler.dump_traceback_later(float(os.environ["HPDL_SERVE_FAULTHANDLER"]), exit=False)
        model = build_model(spec, ctx.device, dist.group.WORLD)
        self.runner = ModelRunner(model, args.num_slots, args.max_seq_len, ctx.world_size, args.cuda_graph,
                                  args.tp_all_reduce, fused=args.fused_decode, fused_gemm=args.fused_gemm)

    def __call__(self, plan: StepPlan) -> None:
        self.runner.execute(plan)

    def close(self) -> None:
        """Drop the CUDA graphs before the process group goes (``ModelRunner.close``)."""
        self.runner.close()


class TPExecutor:
    """Tensor parallelism over ``world`` ranks on one host: a :class:`hpdl.runtime.WorkerGroup` with this process
    as rank 0 (``driver=True``) and a :class:`_TPRank` service on ranks 1..world-1.

    Every step, rank 0 posts the plan to the ranks (one frame, written to each rank's pipe by this thread: no
    feeder thread, no reply), then all ranks run the same forward, whose collectives (NCCL on GPU, gloo on CPU)
    join them. A rank that failed or died since the last step is reported by the next ``execute`` as a
    WorkerFailedError naming it; one that fails during a step makes rank 0's collective fail (gloo) and is named
    in the error raised. Ranks sharing a GPU (``ranks_per_gpu`` > 1, for correctness runs of TP on fewer GPUs)
    use gloo, and the row-parallel all-reduce runs over gloo or hpdl.comm's peer kernels (``tp_all_reduce="hpdl"``).

    Raises WorkerFailedError if a worker fails to start (its rank and traceback), CollectiveTimeoutError if the
    ranks do not start within ``HPDL_TIMEOUT`` seconds (they are named), and what rank 0's own start raises.
    """

    retry_safe = False

    def __init__(self, spec: ModelSpec, args: RunnerArgs, world: int):
        if world < 2:
            raise ValueError(f"tensor_parallel_size must be >= 2 for TPExecutor, got {world}")
        kind = "cuda" if args.device.startswith("cuda") else "cpu"
        self._closed = False
        self.group = WorkerGroup(world, device=kind, ranks_per_gpu=args.ranks_per_gpu, driver=True)
        try:
            # the ranks build their shards while this process builds its own: the builds may hold collectives
            self.service = self.group.start_service(_TPRank, spec, args, name="TP rank")
            model = build_model(spec, str(self.group.context.device), dist.group.WORLD)
            self.runner = ModelRunner(model, args.num_slots, args.max_seq_len, world, args.cuda_graph,
                                      args.tp_all_reduce, fused=args.fused_decode, fused_gemm=args.fused_gemm)
            self.config = model.cfg
            self.service.wait_started()
        except BaseException:
            # a failed start (a bad config ModelRunner rejects, a worker that died) must not leave the default
            # process group initialised, or every later TP engine in this process fails with "trying to
            # initialize the default process group twice", nor the workers running
            self._closed = True
            self.group.close(abort=True)
            raise

    def execute(self, plan: StepPlan) -> torch.Tensor:
        self.service.post(dataclasses.replace(plan, requests=[]))  # workers need tensors' inputs only
        try:
            return self.runner.execute(plan)
        except Exception as exc:
            # a rank that failed in this step (its traceback is already in the pipe when gloo reports its exit)
            # is the cause to name, not the collective error rank 0 saw
            failed = self.service.failure(wait=2.0)
            if failed is not None:
                raise failed from exc
            raise

    def shutdown(self) -> None:
        """Stop the workers. Every rank drops its CUDA graphs, then tears its communicator down at the same time
        (a worker destroying its process group waits for rank 0 to do the same: joining first deadlocked on the
        H200s); a teardown that still hangs is abandoned after 10 s and the workers killed after 15 s.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.runner.close()
        finally:
            self.group.close(timeout=15.0)
