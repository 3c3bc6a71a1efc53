"""OpenAI-compatible HTTP server (FastAPI + uvicorn): thin routes over ``OpenAIServing`` and ``AsyncEngine``.

Routes: POST /v1/completions, POST /v1/chat/completions (``stream: true`` = server-sent events ending with
``data: [DONE]``), GET /v1/models, GET /health, GET /metrics (Prometheus). Every error, whatever raised it,
is an OpenAI-shaped JSON body whose ``type`` follows the status (``protocol.ERROR_TYPES``); bad requests never
reach the engine loop, so everyone else keeps being served.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from hpdl.serve.async_engine import AsyncEngine
from hpdl.serve.metrics import ServeMetrics
from hpdl.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body
from hpdl.serve.serving import APIError, OpenAIServing

log = logging.getLogger("hpdl.serve")


def _err(message: str, code: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, code, param), status_code=code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first schema error as (message naming the field, param)."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in first.get("loc", [])]
    kind, msg = first.get("type", ""), str(first.get("msg", exc))
    if kind.startswith("json"):
        return f"the body is not valid JSON: {msg}", None
    param = ".".join(loc[1:]) or None
    if kind == "extra_forbidden":
        return f"unknown field {param!r}: not a parameter this server implements (see docs/serve.md)", param
    msg = msg.removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else f"invalid request: {msg}"), param


def build_app(engine: AsyncEngine, model_name: str, metrics: ServeMetrics, default_max_tokens: int = 16) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``model_name``."""
    app = FastAPI(title="hpdl serve", version="0.1.0")
    serving = OpenAIServing(engine, model_name, default_max_tokens)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _err(message, 400, param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # unknown route, wrong method
        return _err(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):  # a bug: still an OpenAI-shaped body, never plain text
        log.error("unhandled error serving %s", request.url.path, exc_info=exc)
        return _err(f"internal server error: {type(exc).__name__}: {exc}", 500)

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

    def _respond(out):
        if isinstance(out, dict):
            return JSONResponse(out)
        return StreamingResponse(out, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return _respond(await serving.completion(req, raw))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return _respond(await serving.chat(req, raw))

    return app


def run_server(async_engine: AsyncEngine, model_name: str, metrics: ServeMetrics, host: str = "127.0.0.1",
               port: int = 8000, default_max_tokens: int = 16) -> None:
    """Serve until interrupted (blocking), then shut the engine down."""
    import uvicorn

    app = build_app(async_engine, model_name, metrics, default_max_tokens)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        async_engine.shutdown()
