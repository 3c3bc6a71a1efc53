"""OpenAI-compatible HTTP server (FastAPI + uvicorn): thin routes over ``AsyncEngine``.

Routes: POST /v1/completions, POST /v1/chat/completions (``stream: true`` = server-sent events ending with
``data: [DONE]``), GET /v1/models, GET /health, GET /metrics (Prometheus). Bad requests get a 4xx JSON error in
OpenAI's shape; they never reach the engine loop, so everyone else keeps being served.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hpdl.serve.async_engine import AsyncEngine, EngineDeadError
from hpdl.serve.metrics import ServeMetrics
from hpdl.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body


def _err(message: str, code: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, code, param), status_code=code)


def _usage(o) -> dict:
    return {"prompt_tokens": o.prompt_tokens, "completion_tokens": len(o.token_ids),
            "total_tokens": o.prompt_tokens + len(o.token_ids)}


def build_app(engine: AsyncEngine, model_name: str, metrics: ServeMetrics, default_max_tokens: int = 16) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``model_name``."""
    app = FastAPI(title="hpdl serve", version="0.1.0")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", [])[1:]) or None
        return _err(f"invalid request: {first.get('msg', str(exc))} (at {param})", 400, param)

    @app.get("/health")
    async def health():
        if engine.dead_error is not None:
            return _err(f"engine failed: {engine.dead_error!r}", 503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "hpdl",
                                            "max_model_len": engine.engine.config.max_seq_len}]}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _serve(req, prompt_fn, chat: bool):
        if req.model is not None and req.model != model_name:
            return _err(f"model {req.model!r} does not exist; this server has {model_name!r}", 404, "model")
        try:
            params = req.sampling_params(default_max_tokens)
            rid, q = engine.add(prompt_fn(), params)
        except ValueError as exc:
            return _err(str(exc), 400)
        except EngineDeadError as exc:
            return _err(str(exc), 503)
        oid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        head = {"id": oid, "created": created, "model": model_name}
        outs = engine.stream(rid, q)
        if req.stream:
            return StreamingResponse(_sse(outs, head, chat, req.include_usage), media_type="text/event-stream")
        text, last = "", None
        try:
            async for o in outs:
                text, last = text + o.delta, o
        except EngineDeadError as exc:
            return _err(str(exc), 503)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": last.finish_reason}
            return {**head, "object": "chat.completion", "choices": [choice], "usage": _usage(last)}
        choice = {"index": 0, "text": text, "finish_reason": last.finish_reason, "logprobs": None}
        return {**head, "object": "text_completion", "choices": [choice], "usage": _usage(last)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await _serve(req, req.prompt_input, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        msgs = [m.model_dump() for m in req.messages]
        return await _serve(req, lambda: engine.tokenizer.apply_chat_template(msgs), chat=True)

    return app


async def _sse(outs: AsyncIterator, head: dict, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """OpenAI stream chunks as server-sent events, then (optionally) a usage chunk, then ``[DONE]``."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    last = None
    if chat:
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        yield f"data: {json.dumps({**head, 'object': obj, 'choices': [first]})}\n\n"
    try:
        async for o in outs:
            last = o
            if not o.delta and not o.finished:
                continue
            choice = {"index": 0, "finish_reason": o.finish_reason if o.finished else None}
            choice |= {"delta": {"content": o.delta}} if chat else {"text": o.delta, "logprobs": None}
            yield f"data: {json.dumps({**head, 'object': obj, 'choices': [choice]})}\n\n"
    except EngineDeadError as exc:
        yield f"data: {json.dumps(error_body(str(exc), 503))}\n\n"
    if include_usage and last is not None:
        yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'usage': _usage(last)})}\n\n"
    yield "data: [DONE]\n\n"


def run_server(async_engine: AsyncEngine, model_name: str, metrics: ServeMetrics, host: str = "127.0.0.1",
               port: int = 8000, default_max_tokens: int = 16) -> None:
    """Serve until interrupted (blocking), then shut the engine down."""
    import uvicorn

    app = build_app(async_engine, model_name, metrics, default_max_tokens)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        async_engine.shutdown()
