"""The group's worker: one thread per process group that runs hpdl's own asynchronous CPU schedules in call order.

``async_op=True`` on a CPU tensor with one of hpdl's point-to-point schedules (direct, ring, recursive
doubling, two-level, pairwise ...) queues the whole call (argument check, schedule, copy-back) on the group's
:class:`GroupWorker` and returns at once; :class:`Job` is what the returned ``Work`` waits on. One thread per
group, taking jobs first in, first out, keeps every rank's schedules on the group in the order they were
called, which is what matches them across ranks (their messages are paired by peer and tag in posting order).
The heavy parts (gloo's sends, receives and waits; torch's reductions) release the GIL, so the caller's
computation (a backward pass, a stencil) runs meanwhile.

The thread starts at the first queued job and is a daemon; :meth:`GroupWorker.close` (``hpdl.comm.forget_group``,
``hpdl.comm.reset``, interpreter exit) fails the jobs not yet started and lets the running one finish within
its own timeouts, so Ctrl-C and teardown never wait on a queue.
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
import weakref
from typing import Callable

from hpdl.runtime.errors import CollectiveTimeoutError, HpdlError


class Job:
    """One queued call: ``fn()`` runs on the worker, then the finishing steps added with :meth:`then`.

    ``wait(timeout)`` blocks until done and re-raises the call's exception (on every waiter, every time);
    ``is_completed()`` polls; ``get_future()`` is a ``torch.futures.Future`` completed with ``result`` (or the
    exception) by the worker thread.
    """

    def __init__(self, fn: Callable[[], object], what: str, result=None):
        self.fn, self.what, self.result = fn, what, result
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._finish: list[Callable[[], object]] = []
        self._futures: list = []
        self.worker: "GroupWorker | None" = None  # set when queued

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiters
            self.error = exc
        self.fn = None   # drop the closure (tensors) as soon as it ran
        self._complete()

    def fail(self, exc: BaseException) -> None:
        """Complete without running (the worker was closed before this job started)."""
        self.error, self.fn = exc, None
        self._complete()

    def _complete(self) -> None:
        with self._lock:
            fns, self._finish = self._finish, []
        if self.error is None:
            try:
                for f in fns:
                    f()
            except BaseException as exc:  # noqa: BLE001
                self.error = exc
        with self._lock:
            self._done.set()
            futures, self._futures = self._futures, []
        for fut in futures:
            self._settle(fut)

    def _settle(self, fut) -> None:
        if self.error is not None:
            fut.set_exception(self.error)
        else:
            fut.set_result(self.result)

    def then(self, fn: Callable[[], object]) -> "Job":
        """Run ``fn`` after the call succeeded: on the worker, or now when the job is already complete."""
        with self._lock:
            if not self._done.is_set():
                self._finish.append(fn)
                return self
        if self.error is None:
            fn()
        return self

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the job finished (``timeout`` seconds at most, None = as long as its own waits take);
        re-raise its error. Interruptible (Ctrl-C) in the main thread, wherever the signal lands.

        Raises:
            CollectiveTimeoutError: still running (or queued) after ``timeout`` seconds.
            RuntimeError: called on its own worker's thread (a future's callback, or an earlier job) before it
                ran: it could never run there (the worker would wait for itself forever).
        """
        w = self.worker
        if not self._done.is_set() and w is not None and w.is_current():
            raise RuntimeError(f"{self.what}: wait() on the group's worker thread (in a future's callback or an "
                               "earlier async call) for a call queued after it would never return; wait for it "
                               "outside the callback")
        # In slices: Python runs signal handlers on the main thread only, and a SIGINT the kernel delivers to
        # another thread (the worker inside gloo's recv) does not wake a main thread blocked on a lock; an
        # unbounded wait then held the KeyboardInterrupt until the call ended, forever for a hung peer.
        end = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            left = _SLICE_S if end is None else min(_SLICE_S, end - time.monotonic())
            if left <= 0:
                break
            self._done.wait(left)
        if not self._done.is_set():
            raise CollectiveTimeoutError(f"{self.what} (async, on the group's worker) did not complete within "
                                         f"{timeout:.0f}s")
        if self.error is not None:
            raise self.error

    def get_future(self):
        import torch

        fut = torch.futures.Future()
        with self._lock:
            if not self._done.is_set():
                self._futures.append(fut)
                return fut
        self._settle(fut)
        return fut


_SLICE_S = 0.05   # longest a waiting thread sleeps before a pending signal's handler can run


class WorkerClosedError(HpdlError):
    """A queued call that never started: its group's worker was closed (``forget_group``, ``reset``, exit)."""


class GroupWorker:
    """A FIFO of :class:`Job` and the one daemon thread that runs it.

    Args:
        name: the group's name (the thread is ``hpdl-comm-<name>``).

    ``outstanding`` counts jobs queued or running; :meth:`drain` waits until it is zero, which a synchronous
    call on the same group does first so that it runs after every earlier asynchronous one. Futures of jobs
    (``Work.get_future()``) complete on the worker thread, so their callbacks run there, between two jobs: a
    callback may issue calls on the group, but must not wait for a Work issued after its own.
    """

    def __init__(self, name: str):
        self.name = name
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._after_close: list[Callable[[], object]] = []
        self.outstanding = 0
        _LIVE.add(self)

    def submit(self, job: Job) -> Job:
        with self._cv:
            if self._closed:
                job.fail(WorkerClosedError(f"{job.what}: the group's worker is closed (hpdl.comm.forget_group / "
                                           "reset was called, or the process is exiting)"))
                return job
            job.worker = self
            self._queue.append(job)
            self.outstanding += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"hpdl-comm-{self.name}", daemon=True)
                self._thread.start()
            self._cv.notify()
        return job

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._closed:
                        self._cv.wait()
                    if not self._queue:
                        return
                    job = self._queue.popleft()
                try:
                    job.run()
                finally:
                    with self._cv:
                        self.outstanding -= 1
                        self._cv.notify_all()
        finally:
            self._run_after_close()

    def _run_after_close(self) -> None:
        with self._cv:
            fns, self._after_close = self._after_close, []
        for fn in fns:
            fn()

    def is_current(self) -> bool:
        """True when called on this worker's thread."""
        return self._thread is not None and self._thread is threading.current_thread()

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every job submitted so far has finished (their errors stay with their Works).

        Raises:
            CollectiveTimeoutError: jobs still running after ``timeout`` seconds.
        """
        if self.outstanding == 0 or self.is_current():
            # on the worker itself (a future's callback issuing a synchronous call) the earlier jobs are done
            # and the later ones have not started: the call runs in order right here
            return
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self.outstanding:
                left = _SLICE_S if end is None else min(_SLICE_S, end - time.monotonic())
                if left <= 0:
                    raise CollectiveTimeoutError(f"{self.outstanding} earlier async call(s) on group {self.name} "
                                                 f"did not finish within {timeout:.0f}s")
                # in slices, as Job.wait: a SIGINT delivered to the worker thread must still end this wait
                self._cv.wait(left)

    def close(self, join_s: float = 1.0, then: Callable[[], object] | None = None) -> None:
        """Fail the jobs not yet started, stop the thread after the running job; no communication.

        ``then`` runs once no job runs any more: here when the thread ended within ``join_s`` (or never
        started), else on the worker thread right after its running job returns (what that job uses, such as
        the group's algorithms and buffers, must not be freed under it)."""
        with self._cv:
            if then is not None:
                self._after_close.append(then)
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self.outstanding -= len(dropped)
            self._cv.notify_all()
            thread = self._thread
        for job in dropped:
            job.fail(WorkerClosedError(f"{job.what}: not started; the group's worker was closed"))
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_s)
        if thread is None or not thread.is_alive():
            self._run_after_close()  # (else the thread runs it as it ends; whoever pops the list runs it once)
        _LIVE.discard(self)


_LIVE: "weakref.WeakSet[GroupWorker]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:   # before torch tears the process groups down under a running job
    for w in list(_LIVE):
        w.close(join_s=0.5)
