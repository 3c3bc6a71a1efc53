"""Every ``HPDL_*`` environment variable, typed and read lazily (one home, as vLLM's ``envs.py``).

Configuration order everywhere in hpdl: function argument, then the variable below, then the default.
``python -m hpdl.runtime.env`` prints the table of every variable; each subsystem's page holds its own rows
(docs/comm.md and docs/offload.md, section "Configuration"; docs/moe.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


def _bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false), got {value!r}")


REGISTRY: dict[str, EnvVar] = {}


def _declare(name: str, parse: Callable[[str], Any], default: Any, doc: str) -> None:
    REGISTRY[name] = EnvVar(name, parse, default, doc)


_declare("HPDL_TIMEOUT", float, 300.0, "Seconds a collective or rendezvous waits for a peer before it raises; "
         "hpdl.serve: the longest one engine step may run before the server is declared failed (time a request "
         "waits in the queue never counts).")
def _check_mode(value: str):
    return "auto" if value.strip().lower() == "auto" else _bool(value)


_declare("HPDL_CHECK", _check_mode, "auto",
         "Check before each collective that all ranks passed the same count, dtype, op, device and algorithm "
         "(a small direct exchange of the call's signature). `auto`: on for CPU tensors, off for CUDA tensors "
         "(whose fast paths take a few microseconds); `1`/`0` force it. Benchmarks turn it off when timing.")
_declare("HPDL_TUNING_FILE", str, "", "Path of a JSON tuning table written by `hpdl bench allreduce --tune`.")
_declare("HPDL_DIRECT_WINDOW", int, 0, "Throttle window k of the direct algorithm (0 = use the tuned default).")
_declare("HPDL_RANKS_PER_NODE", str, "",
         "Emulated ranks per node for two-level algorithms when no topology was set (e.g. `4` or `3,2`); "
         "empty = nodes from hostnames.")
_declare("HPDL_RANKS_PER_GPU", int, 1,
         "Ranks that share one CUDA device (local rank r uses `cuda:(r // ranks_per_gpu)`); above 1 the data "
         "group is gloo (NCCL refuses two ranks on one device) and CUDA tensors move through hpdl's peer-memory "
         "kernels or host staging. For correctness at 2-8 ranks on one GPU; its timings are not multi-GPU "
         "performance. Set by `hpdl.runtime.spawn(..., ranks_per_gpu=N)` in every rank; set it yourself under "
         "torchrun.")
_declare("HPDL_MPS", _bool, False,
         "With HPDL_RANKS_PER_GPU > 1 under `hpdl.runtime.spawn`: run the ranks as clients of a private NVIDIA "
         "MPS daemon that hpdl starts and stops (kernels of the ranks then run concurrently, not time-sliced).")
_declare("HPDL_PIPELINE_DEPTH", int, 4, "Chunks per shard of the two-level all-reduce's early-trigger pipeline.")
_declare("HPDL_TWO_LEVEL_INTER", str, "auto",
         "Algorithm of the two-level all-reduce among one rail's ranks: ring, direct, recursive_doubling (hpdl, "
         "over the group's transport), native (torch.distributed on one new_group per rail; world group only) or "
         "auto (native on the world group, ring otherwise).")
_declare("HPDL_LOG_LEVEL", str, "WARNING", "Log level of the `hpdl` logger.")


def _start_method(value: str) -> str:
    v = value.strip().lower()
    if v not in ("forkserver", "spawn"):
        raise ValueError("expected 'forkserver' or 'spawn'")
    return v


_declare("HPDL_HPO_START_METHOD", _start_method, "forkserver",
         "How hpdl.hpo starts local trial workers: `forkserver` (fork from one server that imported torch, "
         "`torch._dynamo` and optuna once; Linux and macOS) or `spawn` (a fresh interpreter each).")
_declare("HPDL_HPO_CPU_THREADS", int, 1, "Intra-op CPU threads of each hpdl.hpo trial worker.")
_declare("HPDL_OFFLOAD_PROGRESS", str, "auto",
         "Who runs started hpdl.offload plans: `agent` (the node's progress agent), `thread` (an in-process "
         "progress thread), `graph` (CUDA graphs of the ranks' own copies: CUDA buffers of one host, single-phase "
         "plans) or `auto` (the agent when this process is connected to one, else the thread).")
_declare("HPDL_OFFLOAD_AGENT", str, "", "Unix socket of a running `hpdl offload agent` that hpdl.offload.compile "
         "connects to (empty: only agents started with hpdl.offload.Agent).")
_declare("HPDL_OFFLOAD_SPIN_US", float, 50.0,
         "Microseconds an offload executor keeps polling after activity before it sleeps on its doorbell.")
_declare("HPDL_OFFLOAD_NATIVE", str, "auto",
         "hpdl.offload agents run intra-node CPU plans on the native executor (a C engine built with gcc on first "
         "use): `auto` (when it builds, else the Python executor, with one log line), `1` (required: error if it "
         "cannot be built) or `0` (always the Python executor).")
_declare("HPDL_OFFLOAD_CORES", str, "",
         "Comma-separated cores an offload agent's native executor pins its threads to (default: the last "
         "`threads` cores of the process's affinity when as many are left for the ranks, else not pinned).")
_declare("HPDL_OFFLOAD_CUDA_COPY", str, "kernel",
         "How hpdl.offload copies between buffers of one GPU (progress='graph' pulls; an agent's copies, read when "
         "the agent starts): `kernel` (cudaMemcpyAsync, captured in a CUDA graph for 'graph', which the driver may "
         "run as copy kernels on the SMs) or `ce` (contiguous boxes by cudaMemcpyBatchAsync preferring the copy "
         "engines, CUDA >= 12.8; strided boxes stay as they were).")
_declare("HPDL_OFFLOAD_SHM_DIR", str, "", "Directory of hpdl.offload's shared-memory files (default /dev/shm).")
_declare("HPDL_MOE_ILP_TIME_LIMIT", float, 60.0,
         "Seconds HiGHS may spend on one hpdl.moe placement (shared by the sub-programs of a bisection) when "
         "the caller passes no time limit; the best point found by then is used, or the greedy placement.")
_declare("HPDL_MOE_CHECK", _check_mode, "auto",
         "hpdl.moe engine: the `check` argument it passes to hpdl.comm's collectives (`auto` = HPDL_CHECK's "
         "rule, `0` when timing); `hpdl moe bench` turns it off.")
_declare("HPDL_DATA_DIR", str, "",
         "Folder of the offline datasets hpdl generates (e.g. `hpdl vision`'s shapes set); empty = ~/.cache/hpdl/data.")
_declare("HPDL_COMMIT", str, "", "Commit that benchmark results record (`hpdl.bench.report.source_commit`); "
         "set it where the checkout has no .git, e.g. the device machine's copy of a working tree.")


def get(name: str) -> Any:
    """Value of ``name`` from the environment, parsed, or its default.

    Raises:
        KeyError: ``name`` is not a declared hpdl variable.
        ValueError: the variable is set to a value its parser rejects; the message names the variable.
    """
    var = REGISTRY[name]
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return var.default
    try:
        return var.parse(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is invalid: {exc}") from None


def table() -> str:
    """Markdown table of every variable, its default and meaning."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for var in REGISTRY.values():
        rows.append(f"| `{var.name}` | `{var.default!r}` | {var.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
