"""AsyncEngine: drives ``LLMEngine.step`` from one background thread for asyncio servers (the engine client).

Only the engine thread touches the engine. Callers validate a request on their own thread (``prepare``, which
reads no engine state), then hand it over through an inbox that the engine thread drains before each step;
aborts travel the same way. So a caller never waits for a step, and an abort frees the request's slot before
the next step. Outputs go to one ``asyncio.Queue`` per request through ``call_soon_threadsafe``.

Failures: a request that fails alone inside a step gets a final output with ``finish_reason='error'``. When
``step`` itself raises (an engine fault) or one step runs longer than ``step_timeout`` seconds (a hung device
or collective), the engine is dead: every open request receives ``EngineDeadError`` at once and ``dead_error``
is set (``/health`` fails). Time a request spends queued never counts against any timeout.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

from hpdl.runtime import env
from hpdl.runtime.errors import HpdlError
from hpdl.serve.engine import LLMEngine, RequestOutput
from hpdl.serve.metrics import ServeMetrics
from hpdl.serve.sampling import SamplingParams
from hpdl.serve.scheduler import Request

log = logging.getLogger("hpdl.serve")


class EngineDeadError(HpdlError):
    """The engine loop failed; no request can be served any more."""


class AsyncEngine:
    """Thread-safe, asyncio-facing client of one ``LLMEngine``.

    Args:
        step_timeout: seconds one ``step`` may run before the engine is declared hung (default
            ``HPDL_TIMEOUT``). It bounds a single step, never a request's wait in the queue.
    """

    def __init__(self, engine: LLMEngine, metrics: ServeMetrics | None = None, step_timeout: float | None = None):
        self.engine, self.metrics = engine, metrics
        self.step_timeout = float(step_timeout if step_timeout is not None else env.get("HPDL_TIMEOUT"))
        self._lock = threading.Condition()  # guards _streams, _inbox, dead_error
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._inbox: list[tuple[str, Request | str]] = []  # ("add", Request) | ("abort", request id)
        self._stop = False
        self._stopped = threading.Event()  # wakes the watchdog at shutdown
        self._step_started: float | None = None
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="hpdl-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="hpdl-engine-watchdog", daemon=True)
        self._thread.start()
        self._watchdog.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # --- the engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        while True:
            with self._lock:
                while not self._stop and not self._inbox and not eng.has_unfinished():
                    self._lock.wait(timeout=0.5)
                if self._stop or self.dead_error is not None:
                    return
                commands, self._inbox = self._inbox, []
            for kind, item in commands:
                try:
                    eng.add(item) if kind == "add" else eng.abort(item)
                except Exception as exc:  # noqa: BLE001 - validated already; if not, that request fails alone
                    self._deliver_error(item.request_id if kind == "add" else item, exc)
            try:
                self._step_started = time.monotonic()
                outs = eng.step()
                stats = eng.stats()
            except BaseException as exc:  # noqa: BLE001 - every open request must hear about it
                log.exception("engine step failed")
                self._die(exc)
                return
            finally:
                self._step_started = None
            if self.dead_error is not None:  # the watchdog gave up on this step
                return
            if self.metrics is not None:
                self.metrics.on_step(stats, outs)
            with self._lock:
                targets = [(self._streams.pop(o.request_id, None) if o.finished else self._streams.get(o.request_id),
                            o) for o in outs]
            for entry, o in targets:
                if entry is not None:
                    _put(entry, o)

    def _watch(self) -> None:
        """Declares the engine dead when one step runs past ``step_timeout`` (a hung device or collective)."""
        period = min(1.0, self.step_timeout / 4)
        while not self._stopped.wait(period) and self.dead_error is None:
            started = self._step_started
            if started is not None and time.monotonic() - started > self.step_timeout:
                log.error("an engine step has run for more than %.0f s (HPDL_TIMEOUT)", self.step_timeout)
                self._die(TimeoutError(f"an engine step ran for more than {self.step_timeout:g} s (HPDL_TIMEOUT)"))

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            if self.dead_error is not None:
                return
            self.dead_error = exc
            entries, self._streams = list(self._streams.values()), {}
            self._lock.notify_all()
        for entry in entries:
            _put(entry, EngineDeadError(f"engine failed: {exc!r}"))

    def _deliver_error(self, rid: str, exc: BaseException) -> None:
        with self._lock:
            entry = self._streams.pop(rid, None)
        if entry is not None:
            _put(entry, exc)

    # --- callers (any thread; stream() on the caller's event loop) --------------------------------
    def prepare(self, prompt: str | list[int], params: SamplingParams) -> Request:
        """Tokenize and validate (``LLMEngine.make_request``); raises InvalidParamError, queues nothing."""
        return self.engine.make_request(prompt, params)

    def submit(self, requests: list[Request]) -> list[asyncio.Queue]:
        """Queue prepared requests together (all or none); their outputs arrive on the returned queues."""
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in requests]
        with self._lock:
            if self.dead_error is not None:
                raise EngineDeadError(f"engine failed: {self.dead_error!r}")
            if self._stop:
                raise EngineDeadError("engine is shutting down")
            for req, q in zip(requests, queues):
                self._streams[req.request_id] = (loop, q)
                self._inbox.append(("add", req))
            self._lock.notify()
        return queues

    async def stream(self, rid: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Outputs of ``rid`` until it finishes; closing or cancelling the consumer aborts the request.

        Raises EngineDeadError when the engine dies, or the exception that made the engine refuse the request.
        """
        finished = False
        try:
            while not finished:
                o = await q.get()
                if isinstance(o, BaseException):
                    finished = True
                    raise o
                finished = o.finished
                yield o
        finally:
            if not finished:
                with self._lock:
                    self._streams.pop(rid, None)
                self.abort(rid)

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """``prepare`` + ``submit`` + ``stream`` for one request."""
        req = self.prepare(prompt, params)
        (q,) = self.submit([req])
        async for o in self.stream(req.request_id, q):
            yield o

    def abort(self, rid: str) -> None:
        """Abort ``rid`` before the next step (never waits for the engine)."""
        with self._lock:
            if self.dead_error is None and not self._stop:
                self._inbox.append(("abort", rid))
                self._lock.notify()

    def shutdown(self) -> None:
        """Stop the loop after its current step; open requests get EngineDeadError; shut the engine down."""
        with self._lock:
            self._stop = True
            entries, self._streams = list(self._streams.values()), {}
            self._lock.notify_all()
        self._stopped.set()
        for entry in entries:
            _put(entry, EngineDeadError("engine shut down"))
        self._thread.join(timeout=30)
        self._watchdog.join(timeout=5)
        self.engine.shutdown()


def _put(entry: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item) -> None:
    loop, q = entry
    try:
        loop.call_soon_threadsafe(q.put_nowait, item)
    except RuntimeError:  # that client's event loop is closed: nobody is listening
        pass
