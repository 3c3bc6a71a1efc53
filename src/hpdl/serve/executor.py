"""Executors hide process topology from the engine: one process, or tensor-parallel over torch.distributed.

``TPExecutor`` makes the engine's process rank 0 and spawns ranks 1..world-1 (spawn start method). Every
step, rank 0 sends the plan (a small picklable object) to each worker over a pipe, then all
ranks run the same forward, whose collectives (NCCL on GPU, gloo on CPU) join them. Plans travel over
pipes written synchronously by the caller (a ``multiprocessing.Queue`` would hand them to a feeder thread
that must win the GIL first, adding up to a switch interval of latency to every step). Only rank 0 samples;
the next plan carries the sampled tokens, so every rank sees the same inputs (vLLM v0's driver-worker shape).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpdl.runtime import env
from hpdl.runtime.errors import WorkerFailedError
from hpdl.runtime.launch import free_port
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
    ranks_per_gpu: int | None = None   # TP ranks sharing one GPU (None: HPDL_RANKS_PER_GPU); see _init_rank
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


def _init_rank(rank: int, world: int, port: int, device: str, ranks_per_gpu: int | None = None) -> str:
    """Join the TP group: rank r on ``cuda:(r // ranks_per_gpu)`` with NCCL, or, when ranks share a GPU
    (``ranks_per_gpu`` > 1, for correctness runs of TP on fewer GPUs), with gloo (the row-parallel all-reduce
    then runs over gloo, or hpdl.comm's peer kernels with ``tp_all_reduce="hpdl"``)."""
    from hpdl.runtime.launch import job_ranks_per_gpu, join_local

    kind = "cuda" if device.startswith("cuda") else "cpu"
    rpg = job_ranks_per_gpu(kind, ranks_per_gpu)
    # hpdl.comm reads it (above 1 it takes CUDA tensors on the gloo group): this job's value, also when 1
    os.environ["HPDL_RANKS_PER_GPU"] = str(rpg)
    dev, _ = join_local(rank, world, port, kind, rpg)
    return str(dev)


def _worker_main(rank: int, world: int, port: int, spec: ModelSpec, args: RunnerArgs, inbox, errors) -> None:
    """Rank >= 1: build its shard, then run every plan rank 0 sends until it sends None."""
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if os.environ.get("HPDL_SERVE_FAULTHANDLER"):  # debugging hangs: dump every thread's stack later
            import faulthandler

            faulthandler.dump_traceback_later(float(os.environ["HPDL_SERVE_FAULTHANDLER"]), exit=False)
        device = _init_rank(rank, world, port, args.device, args.ranks_per_gpu)
        model = build_model(spec, device, dist.group.WORLD)
        runner = ModelRunner(model, args.num_slots, args.max_seq_len, world, args.cuda_graph, args.tp_all_reduce,
                             fused=args.fused_decode, fused_gemm=args.fused_gemm)
        errors.put((rank, None))  # ready
        while True:
            if not inbox.poll(5.0):
                if os.getppid() == 1:  # the driver died: do not linger
                    return
                continue
            plan = inbox.recv()
            if plan is None:
                break
            runner.execute(plan)
        runner.close()
        _destroy_bounded(10.0)
    except BaseException:  # noqa: BLE001 - report any failure to rank 0 with its traceback
        errors.put((rank, traceback.format_exc()))


def _destroy_bounded(timeout: float) -> bool:
    """destroy_process_group, given up after ``timeout`` seconds (the process then exits with the communicator
    still open, which the driver tolerates); True when it finished."""
    t = threading.Thread(target=dist.destroy_process_group, daemon=True)
    t.start()
    t.join(timeout=timeout)
    return not t.is_alive()


class TPExecutor:
    """Tensor parallelism over ``world`` ranks on one host (this process is rank 0).

    Raises WorkerFailedError if a worker fails to start within ``HPDL_TIMEOUT`` seconds, naming its rank.
    """

    retry_safe = False

    def __init__(self, spec: ModelSpec, args: RunnerArgs, world: int):
        if world < 2:
            raise ValueError(f"tensor_parallel_size must be >= 2 for TPExecutor, got {world}")
        ctx = mp.get_context("spawn")
        port = free_port()
        pipes = [ctx.Pipe(duplex=False) for _ in range(world - 1)]  # (receive end, send end)
        self.inboxes = [send for _, send in pipes]
        self.errors = ctx.Queue()
        self.procs = [ctx.Process(target=_worker_main, args=(r, world, port, spec, args, pipes[r - 1][0],
                                                              self.errors), daemon=True)
                      for r in range(1, world)]
        for p in self.procs:
            p.start()
        try:
            self._start(spec, args, world, port)
        except BaseException:
            # a failed start (a bad config ModelRunner rejects, a worker that died) must not leave the default
            # process group initialised, or every later TP engine in this process fails with "trying to
            # initialize the default process group twice", nor the workers running
            self._abandon()
            raise

    def _start(self, spec: ModelSpec, args: RunnerArgs, world: int, port: int) -> None:
        device = _init_rank(0, world, port, args.device, args.ranks_per_gpu)
        model = build_model(spec, device, dist.group.WORLD)
        self.runner = ModelRunner(model, args.num_slots, args.max_seq_len, world, args.cuda_graph, args.tp_all_reduce,
                                  fused=args.fused_decode, fused_gemm=args.fused_gemm)
        self.config = model.cfg
        ready = set()
        while len(ready) < world - 1:
            try:
                rank, err = self.errors.get(timeout=env.get("HPDL_TIMEOUT"))
            except queue.Empty:
                raise WorkerFailedError(f"TP ranks {sorted(set(range(1, world)) - ready)} did not start") from None
            if err is not None:
                raise WorkerFailedError(f"TP rank {rank} failed:\n{err}")
            ready.add(rank)

    def _abandon(self) -> None:
        """Tear down a start that failed: the workers are ended (they may be waiting in a collective rank 0 will
        never join) and this process's group destroyed, bounded as in ``shutdown``."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if dist.is_initialized():
            _destroy_bounded(10.0)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        wire = dataclasses.replace(plan, requests=[])  # workers need tensors' inputs only
        for rank, conn in enumerate(self.inboxes, start=1):
            try:
                conn.send(wire)
            except (BrokenPipeError, ConnectionError, OSError) as exc:
                raise WorkerFailedError(f"TP rank {rank} is gone (its pipe: {exc!r})") from None
        try:  # a worker that failed since the last step is reported instead of hanging in a collective
            rank, err = self.errors.get_nowait()
            raise WorkerFailedError(f"TP rank {rank} failed:\n{err}")
        except queue.Empty:
            pass
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        """Stop the workers. Every rank drops its CUDA graphs, then tears its communicator down at the same time
        (a worker destroying its process group waits for rank 0 to do the same: joining first deadlocked on the
        H200s); a teardown that still hangs is abandoned after 10 s and the worker terminated."""
        for conn in self.inboxes:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):  # that worker is gone already
                pass
        self.runner.close()
        if dist.is_initialized():
            _destroy_bounded(10.0)
        for p in self.procs:
            p.join(timeout=15)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
