"""AsyncEngine: drives ``LLMEngine.step`` from one background thread for asyncio servers (the engine client).

The engine itself is single-threaded; a lock serialises ``add_request``/``abort`` with ``step`` (a caller
waits at most one step). Outputs go to one ``asyncio.Queue`` per request through ``call_soon_threadsafe``.
If a step raises, the engine is marked dead, every open request receives the error, and ``/health`` fails.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from hpdl.runtime import env
from hpdl.serve.engine import LLMEngine, RequestOutput
from hpdl.serve.metrics import ServeMetrics
from hpdl.serve.sampling import SamplingParams

log = logging.getLogger("hpdl.serve")


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served any more."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServeMetrics | None = None):
        self.engine, self.metrics = engine, metrics
        self._cv = threading.Condition()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="hpdl-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self.engine.has_unfinished():
                    self._cv.wait(timeout=0.5)
                if self._stop:
                    return
                try:
                    outs = self.engine.step()
                    stats = self.engine.stats()
                except BaseException as exc:  # noqa: BLE001 - every open request must hear about it
                    log.exception("engine step failed")
                    self.dead_error = exc
                    for loop, q in self._queues.values():
                        loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"engine failed: {exc!r}"))
                    return
            if self.metrics is not None:
                self.metrics.on_step(stats, outs)
            for o in outs:
                entry = self._queues.get(o.request_id)
                if entry is not None:
                    entry[0].call_soon_threadsafe(entry[1].put_nowait, o)

    def add(self, prompt: str | list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        """Queue a request now (validation errors raise here, before any response starts)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"engine failed: {self.dead_error!r}")
        q: asyncio.Queue = asyncio.Queue()
        with self._cv:
            rid = self.engine.add_request(prompt, params)
            self._queues[rid] = (asyncio.get_running_loop(), q)
            self._cv.notify()
        return rid, q

    async def stream(self, rid: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Outputs of ``rid`` until it finishes; cancelling the consumer aborts the request."""
        finished = False
        try:
            while not finished:
                o = await asyncio.wait_for(q.get(), timeout=env.get("HPDL_TIMEOUT"))
                if isinstance(o, BaseException):
                    raise o
                finished = o.finished
                yield o
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        rid, q = self.add(prompt, params)
        async for o in self.stream(rid, q):
            yield o

    def abort(self, rid: str) -> None:
        with self._cv:
            self.engine.abort(rid)
            self._cv.notify()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)
        self.engine.shutdown()
