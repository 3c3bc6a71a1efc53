"""The OpenAI serving layer (vLLM's ``OpenAIServingCompletion`` / ``OpenAIServingChat``, scaled down).

A validated pydantic request becomes one engine request per prompt and choice (``n``, ``best_of``; choice j of a
seeded request samples with ``seed + j``), all validated before any is queued; their outputs become an OpenAI
response or a stream of server-sent events. Errors are raised as ``APIError`` (status, message, param), which
the routes turn into OpenAI-shaped bodies: 400 for bad input, 404 for an unknown model, 500 for a request
that failed inside the engine (the others go on), 503 once the engine is dead. A client that disconnects
aborts its requests, streaming or not, before the engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from hpdl.serve.async_engine import AsyncEngine, EngineDeadError
from hpdl.serve.engine import RequestOutput
from hpdl.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body
from hpdl.serve.sampling import SEED_RANGE, InvalidParamError, SamplingParams, TokenLogprob
from hpdl.serve.scheduler import Request


class APIError(Exception):
    """An HTTP error with an OpenAI-shaped body (``protocol.error_body``)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def __reduce__(self):   # pickled across processes: Exception's default passes only the message back
        return type(self), (self.status, self.message, self.param), self.__dict__

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param)


@dataclass
class _Choice:
    """One engine request's accumulated output."""

    req: Request
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    started: bool = False  # a stream chunk was sent for it
    offset: int = 0  # text_offset of the next token (completions logprobs)

    def add(self, o: RequestOutput) -> None:
        if o.error is not None:
            raise APIError(500, f"this request failed inside the engine (the server goes on): {o.error}")
        self.text += o.delta
        self.logprobs += o.logprobs or []
        if o.prompt_logprobs is not None:
            self.prompt_logprobs = o.prompt_logprobs
        if o.finished:
            self.finish_reason, self.token_ids = o.finish_reason, o.token_ids
            self.cumulative_logprob = o.cumulative_logprob or 0.0

    @property
    def mean_logprob(self) -> float:
        return self.cumulative_logprob / max(1, len(self.token_ids))


def _choice_params(params: SamplingParams, j: int) -> SamplingParams:
    if j == 0 or params.seed is None:
        return params
    seed = params.seed + j
    return dataclasses.replace(params, seed=seed - 2**64 if seed > SEED_RANGE[1] else seed)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Items of several async iterators as ``(index, item)`` in arrival order; closing it closes them all."""
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, it):
        try:
            async for x in it:
                q.put_nowait((i, x))
            q.put_nowait((i, done))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            q.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, x = await q.get()
            if x is done:
                left -= 1
            elif isinstance(x, BaseException):
                raise x
            else:
                yield i, x
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # their streams abort what did not finish


class OpenAIServing:
    """Completions and chat completions over one ``AsyncEngine`` serving ``model_name``.

    Args:
        default_max_tokens: ``max_tokens`` of a completion request that omits it (OpenAI's 16); a chat request
            without ``max_tokens`` / ``max_completion_tokens`` may fill the context (OpenAI).
    """

    def __init__(self, engine: AsyncEngine, model_name: str, default_max_tokens: int = 16):
        self.engine, self.model_name, self.default_max_tokens = engine, model_name, default_max_tokens
        self._token_text: dict[int, str] = {}

    # --- shared -----------------------------------------------------------------------------------
    def _check_model(self, req) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server has {self.model_name!r}", "model")

    def _submit(self, items: list[tuple[str | list[int], SamplingParams]]) -> tuple[list[_Choice], list]:
        """Validate every (prompt, params) first, then queue them all; 400 / 503 before any response starts."""
        try:
            reqs = [self.engine.prepare(p, sp) for p, sp in items]
        except InvalidParamError as exc:
            raise APIError(400, str(exc), exc.param) from None
        try:
            queues = self.engine.submit(reqs)
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from None
        return [_Choice(r) for r in reqs], queues

    def _watch_disconnect(self, raw, choices: list[_Choice]) -> asyncio.Task | None:
        """A task that aborts ``choices`` when the HTTP client goes away (ASGI ``http.disconnect``)."""
        if raw is None:
            return None

        async def watch():
            while (await raw.receive())["type"] != "http.disconnect":
                pass
            for c in choices:
                self.engine.abort(c.req.request_id)

        return asyncio.ensure_future(watch())

    async def _collect(self, choices: list[_Choice], queues: list, raw) -> None:
        watch = self._watch_disconnect(raw, choices)

        async def one(c, q):
            async for o in self.engine.stream(c.req.request_id, q):
                c.add(o)

        tasks = [asyncio.ensure_future(one(c, q)) for c, q in zip(choices, queues)]
        try:
            await asyncio.gather(*tasks)
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from None
        finally:
            for t in tasks + ([watch] if watch is not None else []):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stream(self, choices: list[_Choice], queues: list, raw, head: dict, include_usage: bool,
                      chunk_of, per_prompt: int, first_chunks: list[dict] = ()) -> AsyncIterator[str]:
        """SSE: ``first_chunks``, then ``chunk_of(index, choice, output)`` per output (None: skip), an error event
        if a request fails or the engine dies, the usage chunk if asked, then ``[DONE]``."""
        watch = self._watch_disconnect(raw, choices)
        merged = _merge([self.engine.stream(c.req.request_id, q) for c, q in zip(choices, queues)])
        try:
            for c in first_chunks:
                yield _sse(c)
            async for i, o in merged:
                c = choices[i]
                c.add(o)
                chunk = chunk_of(i, c, o)
                c.started = True
                if chunk is not None:
                    yield _sse(chunk)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": self._usage(choices, per_prompt)})
        except APIError as exc:
            yield _sse(exc.body())
        except EngineDeadError as exc:
            yield _sse(error_body(str(exc), 503))
        finally:
            if watch is not None:
                watch.cancel()
            await merged.aclose()  # aborts the choices that did not finish
        yield "data: [DONE]\n\n"

    @staticmethod
    def _usage(choices: list[_Choice], per_prompt: int) -> dict:
        """OpenAI's usage: each prompt's tokens once, however many choices (``n``, ``best_of``) it has; every
        choice's tokens, candidates included. ``choices`` holds ``per_prompt`` consecutive choices per prompt."""
        prompt = sum(len(c.req.prompt_ids) for c in choices[::per_prompt])
        done = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _text(self, token_id: int) -> str:
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = self.engine.tokenizer.decode([token_id])
        return s

    def _head(self, prefix: str, obj: str) -> dict:
        return {"id": prefix + uuid.uuid4().hex[:24], "object": obj, "created": int(time.time()),
                "model": self.model_name}

    # --- /v1/completions --------------------------------------------------------------------------
    def _completion_logprobs(self, c: _Choice, pairs: list[tuple[int, TokenLogprob | None]]) -> dict:
        """OpenAI's legacy shape; ``top_logprobs`` holds the top k plus the chosen token (as OpenAI and vLLM)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, e in pairs:
            s = self._text(tid)
            out["tokens"].append(s)
            out["text_offset"].append(c.offset)
            c.offset += len(s)
            out["token_logprobs"].append(None if e is None else e.logprob)
            if e is None:
                out["top_logprobs"].append(None)
            else:
                top: dict[str, float] = {}
                for t, lp in e.top:  # tokens with the same text (partial UTF-8) keep the most likely
                    top.setdefault(self._text(t), lp)
                top.setdefault(s, e.logprob)
                out["top_logprobs"].append(top)
        return out

    def _echo(self, req: CompletionRequest, c: _Choice, i: int) -> tuple[str, list]:
        """The prompt's text and (token, logprob) pairs that ``echo`` puts before choice c of prompt i."""
        p = req.prompt[i]
        text = p if isinstance(p, str) else self.engine.tokenizer.decode(c.req.prompt_ids)
        plp = c.prompt_logprobs or [None] * len(c.req.prompt_ids)
        return text, list(zip(c.req.prompt_ids, plp))

    async def completion(self, req: CompletionRequest, raw=None) -> dict | AsyncIterator[str]:
        """A ``text_completion`` dict, or an SSE iterator when ``req.stream``. Raises APIError."""
        self._check_model(req)
        try:
            params = req.sampling_params(self.default_max_tokens)
        except InvalidParamError as exc:
            raise APIError(400, str(exc), exc.param) from None
        n, k = req.num_choices, req.num_candidates
        choices, queues = self._submit([(p, _choice_params(params, j)) for p in req.prompt for j in range(k)])
        head = self._head("cmpl-", "text_completion")
        want_lp = req.logprobs is not None
        if req.stream:  # k == n here
            def chunk_of(i, c, o):
                text, pairs = o.delta, list(zip(o.new_token_ids, o.logprobs or []))
                if req.echo and not c.started:
                    echo_text, echo_pairs = self._echo(req, c, i // k)
                    text, pairs = echo_text + text, echo_pairs + pairs
                if not text and not o.finished and not (want_lp and pairs):
                    return None
                return {**head, "choices": [{"index": i, "text": text, "finish_reason": o.finish_reason if o.finished
                                             else None, "logprobs": self._completion_logprobs(c, pairs) if want_lp
                                             else None}]}
            return self._stream(choices, queues, raw, head, req.include_usage, chunk_of, k)
        await self._collect(choices, queues, raw)
        out = []
        for i in range(len(req.prompt)):
            cands = choices[i * k:(i + 1) * k]
            if k > n:  # best_of: the n candidates with the highest mean token logprob (OpenAI)
                cands = sorted(cands, key=lambda c: c.mean_logprob, reverse=True)[:n]
            for j, c in enumerate(cands):
                text, pairs = c.text, list(zip(c.token_ids, c.logprobs))
                if req.echo:
                    echo_text, echo_pairs = self._echo(req, c, i)
                    text, pairs = echo_text + text, echo_pairs + pairs
                out.append({"index": i * n + j, "text": text, "finish_reason": c.finish_reason,
                            "logprobs": self._completion_logprobs(c, pairs) if want_lp else None})
        return {**head, "choices": out, "usage": self._usage(choices, k)}

    # --- /v1/chat/completions ---------------------------------------------------------------------
    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict:
        def entry(tid, lp):
            s = self._text(tid)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [entry(e.token_id, e.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in e.top]}
                            for e in lps]}

    async def chat(self, req: ChatCompletionRequest, raw=None) -> dict | AsyncIterator[str]:
        """A ``chat.completion`` dict, or an SSE iterator of ``chat.completion.chunk`` when ``req.stream``."""
        self._check_model(req)
        try:
            params = req.sampling_params(None)
        except InvalidParamError as exc:
            raise APIError(400, str(exc), exc.param) from None
        try:
            prompt = self.engine.tokenizer.apply_chat_template([m.as_dict() for m in req.messages])
        except Exception as exc:  # noqa: BLE001 - a template that rejects these messages
            raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from None
        n = req.num_choices
        choices, queues = self._submit([(prompt, _choice_params(params, j)) for j in range(n)])
        head = self._head("chatcmpl-", "chat.completion")
        if req.stream:
            head["object"] = "chat.completion.chunk"
            first = [{**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]} for j in range(n)]

            def chunk_of(i, c, o):
                lps = o.logprobs or []
                if not o.delta and not o.finished and not lps:
                    return None
                return {**head, "choices": [{"index": i, "delta": {"content": o.delta} if o.delta else {},
                                             "logprobs": self._chat_logprobs(lps) if req.logprobs else None,
                                             "finish_reason": o.finish_reason if o.finished else None}]}
            return self._stream(choices, queues, raw, head, req.include_usage, chunk_of, n, first)
        await self._collect(choices, queues, raw)
        out = [{"index": j, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
                "logprobs": self._chat_logprobs(c.logprobs) if req.logprobs else None} for j, c in enumerate(choices)]
        return {**head, "choices": out, "usage": self._usage(choices, n)}
