"""The GPU pool: which devices a study may use, read again on every scheduling tick (elasticity).

Pool configuration (the study file's ``pool``), one of:

- ``{"fake": 2, "memory_gb": 4, "kind": "cpu", "peak_flops": 5e10}``: N logical devices that train on the
  CPU with a declared memory and compute capacity (CI, laptops). Placement limits are enforced by the
  scheduler exactly as on GPUs; the CPU itself is shared by the worker processes.
- ``{"cuda": "all"}`` or ``{"cuda": [0, 1]}``: local GPUs; kind from the device name (``"NVIDIA H200"`` ->
  ``"H200"``), memory from ``total_memory`` less ``headroom`` (fraction, default 0.05).
  ``speeds: {"H200": 1.0, "A100": 0.5}`` sets per-kind speed factors (default 1.0).
- ``{"devices": [{"id": "g0", "kind": "A100", "memory_gb": 40, "speed": 0.5, "torch_device": "cuda:0"}]}``.
- ``{"file": "pool.yaml"}``: any of the above read from that file on every tick; edit it while a study runs
  to add or remove devices (a removed device's trials are checkpointed and moved).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from hpdl.hpo.errors import HpoConfigError
from hpdl.hpo.policies import GIB, Device


def gpu_kind(name: str) -> str:
    """Short kind from a CUDA device name: ``"NVIDIA H200"`` -> ``"H200"``, ``"NVIDIA A100-SXM4-80GB"`` ->
    ``"A100"``."""
    words = [w for w in name.replace("NVIDIA", "").split() if w]
    return (words[0].split("-")[0] if words else name) or "gpu"


_POOL_KEYS = {"fake", "cuda", "devices", "file", "ray", "headroom", "speeds", "memory_gb", "kind", "peak_flops"}


def build_pool(cfg: dict) -> list[Device]:
    """Devices described by ``cfg`` (see module docstring).

    Raises:
        HpoConfigError: malformed configuration, no CUDA device where ``cuda`` is asked for, duplicate ids.
    """
    if not isinstance(cfg, dict) or not cfg:
        raise HpoConfigError(f"pool={cfg!r}, expected a mapping with 'fake', 'cuda', 'devices' or 'file'")
    if "file" in cfg:
        return build_pool(_read(cfg["file"]))
    unknown = set(cfg) - _POOL_KEYS
    if unknown:
        raise HpoConfigError(f"pool has unknown keys {sorted(unknown)}, expected some of {sorted(_POOL_KEYS)}")
    headroom = float(cfg.get("headroom", 0.05))
    speeds = dict(cfg.get("speeds", {}))
    if "fake" in cfg:
        n = int(cfg["fake"])
        if n < 1:
            raise HpoConfigError(f"pool.fake={n}, expected >= 1")
        gb = float(cfg.get("memory_gb", 4))
        if not gb > 0:
            raise HpoConfigError(f"pool.memory_gb={cfg.get('memory_gb')!r}, expected > 0 (GiB per device)")
        mem = int(gb * GIB)
        kind = str(cfg.get("kind", "cpu"))
        devices = [Device(f"fake:{i}", kind, mem, float(speeds.get(kind, 1.0)), 1.0, "cpu",
                          float(cfg.get("peak_flops", 5e10))) for i in range(n)]
    elif "cuda" in cfg:
        import torch

        if not torch.cuda.is_available():
            raise HpoConfigError("pool.cuda: no CUDA device is visible (use pool: {fake: N} on CPU)")
        ids = range(torch.cuda.device_count()) if cfg["cuda"] == "all" else [int(i) for i in cfg["cuda"]]
        devices = []
        for i in ids:
            prop = torch.cuda.get_device_properties(i)
            kind = gpu_kind(prop.name)
            devices.append(Device(f"cuda:{i}", kind, int(prop.total_memory * (1 - headroom)),
                                  float(speeds.get(kind, 1.0)), 1.0, f"cuda:{i}"))
    elif "devices" in cfg:
        devices = []
        for j, d in enumerate(cfg["devices"]):
            try:
                devices.append(Device(str(d["id"]), str(d.get("kind", "gpu")), int(float(d["memory_gb"]) * GIB),
                                      float(d.get("speed", speeds.get(d.get("kind"), 1.0))),
                                      float(d.get("compute", 1.0)), str(d.get("torch_device", "cpu")),
                                      float(d.get("peak_flops", 5e10 if d.get("torch_device", "cpu") == "cpu" else 0))))
            except KeyError as exc:
                raise HpoConfigError(f"pool.devices[{j}]: missing {exc}") from None
    else:
        raise HpoConfigError(f"pool={cfg!r}: expected one of the keys fake, cuda, devices, file")
    ids = [d.id for d in devices]
    if len(set(ids)) != len(ids):
        raise HpoConfigError(f"pool: duplicate device ids {ids}")
    return devices


def _read(path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise HpoConfigError(f"pool.file={str(p)!r} does not exist")
    d = yaml.safe_load(p.read_text())
    if not isinstance(d, dict):
        raise HpoConfigError(f"pool.file={str(p)!r}: expected a mapping")
    return d


class PoolSource:
    """Current devices of the pool; with ``{"file": ...}`` the file is re-read when it changes.

    A file that is momentarily unreadable or invalid (an editor mid-write) keeps the last good pool.
    """

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self._devices = build_pool(cfg)
        self._mtime = self._stat()

    def _stat(self) -> float | None:
        f = self.cfg.get("file") if isinstance(self.cfg, dict) else None
        return os.stat(f).st_mtime_ns if f and os.path.exists(f) else None

    def devices(self) -> list[Device]:
        m = self._stat()
        if m is not None and m != self._mtime:
            try:
                self._devices = build_pool(self.cfg)
                self._mtime = m
            except (HpoConfigError, yaml.YAMLError):
                pass
        return list(self._devices)
