"""Start the trial workers' forkserver before anything imports torch in the driver process.

The forkserver imports :mod:`hpdl.hpo._preload` (torch, ``torch._dynamo``, optuna, sqlalchemy: most of a
warm pool's start-up when a process starts its first study) before it forks the first worker. Started
first, it imports them on another core while the driver imports torch and opens its study, instead of
after. This module imports only the standard library (importing any other part of ``hpdl`` imports torch
through ``hpdl.runtime``).
"""

from __future__ import annotations

import multiprocessing as mp
import os


def start_forkserver() -> bool:
    """Start the forkserver with the preload, unless ``HPDL_HPO_START_METHOD`` asks for ``spawn`` or the
    platform has no forkserver; True when it was started (or runs already). The variable is read raw here
    (its declaration, default and validation are in :mod:`hpdl.runtime.env`, which :func:`hpdl.hpo.launch.
    worker_context` uses; an invalid value is reported there)."""
    if os.environ.get("HPDL_HPO_START_METHOD", "forkserver") != "forkserver":
        return False
    if "forkserver" not in mp.get_all_start_methods():
        return False
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(["hpdl.hpo._preload"])  # read when the server starts
    forkserver.ensure_running()  # returns at once; the server imports the preload in the background
    return True
