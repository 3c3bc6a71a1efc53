"""Run a study's trials as Ray tasks on a Ray cluster (``backend: {name: ray}``): "across nodes it runs on Ray".

The driver (:mod:`hpdl.hpo.driver`) stays the one place where trials are sampled, placed and told; only the
process that trains a trial changes. With this backend:

- **Devices.** The pool is ``{ray: all}`` (every GPU of the cluster) or ``{ray: N}``. One placement group
  reserves one bundle ``{"GPU": 1}`` per device, so each device of the pool is one GPU of one node for the
  whole study. A probe task in each bundle reports its node, GPU name and memory (``memory_gb``/``kind``
  from the pool describe a logical GPU without a CUDA device, e.g. ``ray.init(num_gpus=2)`` on a laptop or
  in CI; trials on it train on the CPU).
- **Placement.** The study's policy places a trial on a device exactly as for the local backend; the trial
  then runs as a Ray task in that device's bundle with ``num_gpus`` = the policy's
  :meth:`~hpdl.hpo.policies.SchedulingPolicy.gpu_fraction`: the trial's share of the GPU's memory for
  ``pack``/``pack_hetero`` (so Ray's own accounting agrees with the packing), 1 for ``one_per_gpu``, and the
  fixed fraction for ``fixed_fraction`` (which is then exactly Ray Tune's ``{"gpu": 0.125}``).
- **Messages.** The task connects back to the driver over TCP (``multiprocessing.connection``, random
  authkey) and speaks the local worker protocol (profile, done, pruned, preempted, failed; preempt and
  stop from the driver), so profiling, pruning, checkpoints, retries, migration and elasticity work
  unchanged. The study storage must be reachable from every node (a shared file system for SQLite, or a
  PostgreSQL/MySQL URL).
- **Faults.** A task that dies (node lost, process killed) is seen as a dead worker and its configuration
  is retried from its last checkpoint; Ray kills the tasks of a driver that exits.

Ray keeps its worker processes between tasks, so imports, the CUDA context and the loaded study are
reused by later trials in the same process (:func:`hpdl.hpo.worker.ray_trial`); there is no separate warm
pool under Ray.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener, answer_challenge, deliver_challenge
from typing import Any

from hpdl.hpo.errors import HpoConfigError, HpoError
from hpdl.hpo.launch import Launcher, WorkerHandle
from hpdl.hpo.messages import Hello, check
from hpdl.hpo.policies import GIB, Device

_READY_TIMEOUT_S = 120.0  # placement group and probes must be ready within this


def _probe(fake_memory_gb: float, fake_kind: str) -> dict:
    """Runs in a bundle: what this GPU is (real CUDA device or a logical one)."""
    import ray
    import torch

    node = ray.util.get_node_ip_address()
    if torch.cuda.is_available():
        prop = torch.cuda.get_device_properties(0)
        from hpdl.hpo.pool import gpu_kind
        return {"node": node, "kind": gpu_kind(prop.name), "memory": int(prop.total_memory), "cuda": True}
    return {"node": node, "kind": fake_kind, "memory": int(fake_memory_gb * GIB), "cuda": False}


class RayProc:
    """The driver's view of one Ray task, shaped like ``multiprocessing.Process`` (is_alive, join, kill,
    pid, exitcode) so the driver's failure handling applies unchanged."""

    def __init__(self, ref):
        self.ref = ref
        self.pid: int | None = None
        self.exitcode: int | str | None = None

    def _check(self, timeout: float) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=timeout)
        if ready and self.exitcode is None:
            try:
                self.exitcode = 0 if ray.get(self.ref) == "ok" else 1
            except Exception as exc:  # noqa: BLE001 - task crashed, node died or cancelled: report its kind
                self.exitcode = type(exc).__name__
        return bool(ready)

    def is_alive(self) -> bool:
        return not self._check(0)

    def join(self, timeout: float | None = None) -> None:
        self._check(timeout if timeout is not None else 1e9)

    def kill(self) -> None:
        import ray

        ray.cancel(self.ref, force=True)


class RayBackend(Launcher):
    """Devices of a Ray cluster and the launcher of trials on them (see module docstring).

    Args:
        cfg: the study's ``backend`` mapping: ``address`` (``None``/``"auto"``/``"ray://host:10001"``; None
            starts a local Ray unless one is already initialised), ``init`` (more ``ray.init`` keyword
            arguments, e.g. ``{num_cpus: 2, num_gpus: 2}``), ``strategy`` (placement group strategy,
            default ``SPREAD``), ``driver_host`` (address the tasks connect back to; default this node's IP).
        pool_cfg: the study's ``pool``: ``{ray: all | N, memory_gb: 4, kind: cpu, speeds: {...}}``.
        spec: the study as a plain dict (absolute ``storage`` and ``run_dir``), sent with every trial.
    Raises:
        HpoConfigError: ray is not installed, the pool is not a ``ray`` pool, or the cluster has no GPU.
        HpoError: the placement group or the probes were not ready within 120 s.
    """

    def __init__(self, cfg: dict, pool_cfg: dict, spec: dict | None = None):
        super().__init__()
        self.spec = spec or {}
        self._started, self.pg, self._listener = False, None, None
        try:
            import ray
            from ray.util.placement_group import placement_group
        except ImportError:
            raise HpoConfigError("backend ray: the 'ray' package is not installed (pip install 'hpdl[hpo]')") from None
        if not isinstance(pool_cfg, dict) or "ray" not in pool_cfg:
            raise HpoConfigError(f"backend ray: pool={pool_cfg!r}, expected {{ray: all}} or {{ray: N}}")
        self._started = not ray.is_initialized()
        if self._started:
            ray.init(address=cfg.get("address"), include_dashboard=False, log_to_driver=False,
                     **dict(cfg.get("init", {})))
        gpus = int(ray.cluster_resources().get("GPU", 0))
        n = gpus if pool_cfg["ray"] == "all" else int(pool_cfg["ray"])
        if n < 1 or n > gpus:
            self.shutdown()
            raise HpoConfigError(f"pool.ray={pool_cfg['ray']!r}: the Ray cluster has {gpus} GPUs, expected 1..{gpus}")
        self.pg = placement_group([{"GPU": 1}] * n, strategy=str(cfg.get("strategy", "SPREAD")))
        ready, _ = ray.wait([self.pg.ready()], timeout=_READY_TIMEOUT_S)
        if not ready:
            self.shutdown()
            raise HpoError(f"backend ray: placement group of {n} GPUs not ready after {_READY_TIMEOUT_S:.0f} s")
        probe = ray.remote(_probe)
        refs = [probe.options(num_cpus=0, num_gpus=1e-4, scheduling_strategy=self._in(i)).remote(
            float(pool_cfg.get("memory_gb", 4)), str(pool_cfg.get("kind", "cpu"))) for i in range(n)]
        ready, _ = ray.wait(refs, num_returns=n, timeout=_READY_TIMEOUT_S)
        if len(ready) < n:
            self.shutdown()
            raise HpoError(f"backend ray: GPU probes not done after {_READY_TIMEOUT_S:.0f} s")
        speeds = dict(pool_cfg.get("speeds", {}))
        headroom = float(pool_cfg.get("headroom", 0.05))
        self._devices, self._index = [], {}
        for i, p in enumerate(ray.get(refs)):
            mem = int(p["memory"] * (1 - headroom)) if p["cuda"] else p["memory"]
            d = Device(f"{p['node']}/gpu:{i}", p["kind"], mem, float(speeds.get(p["kind"], 1.0)), 1.0,
                       "cuda" if p["cuda"] else "cpu", 0.0 if p["cuda"] else float(pool_cfg.get("peak_flops", 5e10)))
            self._devices.append(d)
            self._index[d.id] = i
        self._authkey = os.urandom(16)
        host = cfg.get("driver_host") or ray.util.get_node_ip_address() or socket.gethostname()
        # no authkey on the listener: each connection's challenge runs in its own thread with a deadline, so a
        # silent connection cannot stall the trials behind it
        self._listener = Listener((host, 0))
        self.address = (host, self._listener.address[1])
        self._conns: dict[int, Any] = {}
        self._pids: dict[int, int] = {}
        self._lock = threading.Lock()
        self._token = 0
        self._closed = False
        self._remote = ray.remote(_trial_entry)
        threading.Thread(target=self._accept, daemon=True, name="hpdl-hpo-ray-accept").start()

    def _in(self, i: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)

    def _accept(self) -> None:
        listener = self._listener
        while not self._closed:
            try:
                conn = listener.accept()
            except OSError:
                continue  # the listener closed (the loop then ends) or a connection failed
            threading.Thread(target=self._handshake, args=(conn,), daemon=True, name="hpdl-hpo-ray-hello").start()

    def _handshake(self, conn, deadline_s: float = 30.0) -> None:
        """Authenticate one connection and read its hello; closed if it does not finish within the deadline."""
        timer = threading.Timer(deadline_s, conn.close)
        timer.start()
        try:
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
            if not conn.poll(deadline_s):
                raise EOFError("no hello")
            hello = conn.recv()
            if not isinstance(hello, Hello):
                raise ValueError(f"expected Hello, got {type(hello).__name__}")
            check(hello)  # another protocol version: refused (the trial then fails as died, with this logged)
            token, pid = hello.token, hello.pid
        except HpoError as exc:
            logging.getLogger("hpdl.hpo").error("Ray task refused: %s", exc)
            conn.close()
            return
        except (OSError, EOFError, ValueError, TypeError, AuthenticationError):
            conn.close()  # a refused handshake, a stray message, a silent peer, or the listener closed
            return
        finally:
            timer.cancel()
        with self._lock:
            self._conns[token], self._pids[token] = conn, pid

    def devices(self) -> list[Device]:
        """The pool (fixed for the study: one bundle per GPU)."""
        return list(self._devices)

    def start(self, device: Device, task, sm_percent: int = 100, fraction: float = 1.0) -> WorkerHandle:
        """Start ``task`` as a Ray task in ``device``'s bundle with ``num_gpus=fraction`` (``sm_percent`` is
        not used: Ray starts the process). Its channel is attached by :meth:`connect` once it calls back.

        Raises:
            HpoConfigError: ``fraction`` outside (0, 1].
        """
        if not 0 < fraction <= 1:
            raise HpoConfigError(f"fraction={fraction}, expected 0 < fraction <= 1")
        self._token += 1
        ref = self._remote.options(num_cpus=0, num_gpus=fraction, max_retries=0,
                                   scheduling_strategy=self._in(self._index[device.id]),
                                   name=f"hpdl-trial-{task.number}").remote(
            self.address, self._authkey, self._token, device.__dict__, self.spec, task)
        w = WorkerHandle(RayProc(ref), None, device.id, token=self._token)
        self.workers.append(w)
        return w

    def connect(self) -> None:
        """Attach the connections of tasks that called back since the last tick."""
        with self._lock:
            for w in self.workers:
                if w.conn is None and w.token in self._conns:
                    w.conn, w.proc.pid = self._conns.pop(w.token), self._pids.pop(w.token)
                    w.ready = True

    def shutdown(self) -> None:
        """Stop the trials, close the listener, remove the placement group and stop Ray if this backend
        started it; idempotent."""
        import ray

        super().shutdown()
        self._closed = True
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.pg is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.pg)
            self.pg = None
        if self._started and ray.is_initialized():
            time.sleep(0.1)  # let cancelled tasks report before the runtime goes away
            ray.shutdown()


def _trial_entry(address, authkey, token, device, spec, task) -> str:
    from hpdl.hpo.worker import ray_trial

    return ray_trial(address, authkey, token, device, spec, task)
