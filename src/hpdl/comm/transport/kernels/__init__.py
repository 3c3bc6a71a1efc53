"""CUDA kernels of hpdl.comm, built from the sources in this folder on first use.

``load_peer_allreduce()`` compiles ``peer_allreduce.cu`` (torch-free kernels) and ``binding.cpp`` (a pybind11
module that passes raw pointers and the current CUDA stream) with ``torch.utils.cpp_extension.load`` into
``~/.cache/hpdl/<torch version>-sm<capability>/`` and caches the module for the process. The build needs nvcc
and a CUDA build of torch; it takes about 30 s once per machine, later imports reuse the build.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import ModuleType

import torch

_HERE = Path(__file__).resolve().parent
_LOCK = threading.Lock()
_MODULE: ModuleType | None = None


def build_dir() -> Path:
    """Where the extension is built: ``~/.cache/hpdl/peer_allreduce-torch<version>-sm<major><minor>``."""
    major, minor = torch.cuda.get_device_capability()
    tag = f"peer_allreduce-torch{torch.__version__.replace('+', '_')}-sm{major}{minor}"
    return Path(os.path.expanduser("~/.cache/hpdl")) / tag


def load_peer_allreduce(verbose: bool = False) -> ModuleType:
    """Build (once) and import the peer all-reduce extension.

    Returns:
        The module with ``create``, ``release`` and ``all_reduce`` (see ``binding.cpp``).

    Raises:
        RuntimeError: torch has no CUDA, or the build failed (the compiler output is in the message).
    """
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    with _LOCK:
        if _MODULE is not None:
            return _MODULE
        if not torch.cuda.is_available() or torch.version.cuda is None:
            raise RuntimeError("the peer all-reduce kernels need a CUDA build of torch and a visible GPU")
        from torch.utils.cpp_extension import load

        major, minor = torch.cuda.get_device_capability()
        arch = f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"
        out = build_dir()
        out.mkdir(parents=True, exist_ok=True)
        _MODULE = load(
            name="hpdl_peer_allreduce",
            sources=[str(_HERE / "binding.cpp"), str(_HERE / "peer_allreduce.cu"), str(_HERE / "peer_alltoall.cu")],
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=["-O3", "-std=c++17", arch],
            extra_include_paths=[str(_HERE)],
            build_directory=str(out),
            verbose=verbose,
        )
        return _MODULE
