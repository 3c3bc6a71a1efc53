"""Start the trial workers' forkserver before anything imports torch in the driver process.

The forkserver imports :mod:`hpdl.hpo._preload` (torch, ``torch._dynamo``, optuna, sqlalchemy: most of a
warm pool's start-up when a process starts its first study) before it forks the first worker. Started
first, it imports them on another core while the driver imports torch and opens its study, instead of
after. This module imports only the standard library (importing any other part of ``hpdl`` imports torch
through ``hpdl.runtime``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time

_IMPORTED_AT = time.time()  # the fallback start of `hpdl hpo run`'s counted-in clock (see process_started_at)


def process_started_at() -> float:
    """Unix time (s) this process started: the origin of the counted-in clock of ``hpdl hpo run``
    (:class:`hpdl.hpo.driver.StudyResult`).

    On Linux, now minus the process's age, from ``/proc/self/stat`` (start time in clock ticks since boot) and
    ``/proc/uptime`` (10 ms resolution). ``psutil.Process().create_time()`` adds the start ticks to the boot
    time of ``/proc/stat``, whole seconds, and put the start 0.3 s early in three tries on the development
    machine; it is the fallback elsewhere. Last resort: the time this module was first imported (the CLI
    imports it before anything heavy; only the interpreter's own start is then left out). Never later than
    that."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime (after pid and comm)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return min(_IMPORTED_AT, time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return min(_IMPORTED_AT, float(psutil.Process().create_time()))
    except Exception:  # noqa: BLE001 - no psutil: the earliest time this process recorded
        return _IMPORTED_AT


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
    with children_ignore_sigint():  # Ctrl-C during its start-up killed it (EOFError at the first worker)
        forkserver.ensure_running()  # returns at once; the server imports the preload in the background
    return True


@contextlib.contextmanager
def children_ignore_sigint():
    """Processes started (fork and exec) inside this block start with SIGINT ignored, so Ctrl-C, which
    reaches the whole foreground process group, cannot kill them during their interpreter start-up (the
    driver alone decides: it tells them to stop). The disposition SIG_IGN survives exec; a blocked signal
    mask does not (``_posixsubprocess`` clears it). This process loses no signal: SIGINT is blocked while
    it is ignored here (Linux keeps a blocked signal pending even when ignored), then the handler is
    restored and the signal delivered. Does nothing outside the main thread or while other threads run (one
    of them could take the signal while it is ignored)."""
    if (threading.current_thread() is not threading.main_thread() or threading.active_count() > 1
            or not hasattr(signal, "pthread_sigmask")):
        yield
        return
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    if signal.SIGINT in signal.sigpending():  # it came already: ignoring it now would drop it
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        # None: the previous handler was not set from Python (an embedding or a test runner set it in C);
        # leaving SIG_IGN would make this process ignore Ctrl-C for good, and every process it starts later
        signal.signal(signal.SIGINT, old if old is not None else signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
