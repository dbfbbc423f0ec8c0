"""Wiring: ServeConfig -> tokenizer, supervisor (engine worker), frontend, FastAPI app, uvicorn."""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeferry import __version__
from moeferry.config import ServeConfig
from moeferry.server import anthropic_api, control, metrics, openai_api, tokens_api
from moeferry.server.access import add_access_control
from moeferry.server.generation import Frontend, model_sampling_defaults
from moeferry.server.messages import Ready, WorkerSpec
from moeferry.server.openai_api import error_response
from moeferry.server.protocol import ApiError
from moeferry.server.stats import ServerStats
from moeferry.server.supervisor import Supervisor

log = logging.getLogger("moeferry.server")

# A body larger than this is refused (413) before it is read: a 131072-token prompt as JSON
# token ids is about 1 MiB.
MAX_BODY_BYTES = 32 * 2**20


@dataclass
class Server:
    cfg: ServeConfig
    supervisor: Supervisor
    frontend: Frontend
    stats: ServerStats


def worker_spec(cfg: ServeConfig, factory: str | None = None) -> WorkerSpec:
    return WorkerSpec(cfg.engine, factory) if factory else WorkerSpec(cfg.engine)


def _on_ready(ready: Ready) -> None:
    details = ", ".join(f"{k} {v}" for k, v in ready.details.items())
    log.info("serving: engine worker pid %d ready (%s)", ready.pid, details or "no details")
    if ready.plan_table:
        log.info("memory plan:\n%s", ready.plan_table)


def build_server(cfg: ServeConfig, tokenizer=None, factory: str | None = None, **supervisor_kwargs) -> Server:
    if tokenizer is None:
        from moeferry.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(cfg.model_dir)
    defaults = model_sampling_defaults(cfg.model_dir) if cfg.sampling_defaults == "model" else {}
    if defaults:
        log.info("sampling defaults from generation_config.json: %s",
                 ", ".join(f"{k}={v}" for k, v in defaults.items()))
    supervisor = Supervisor(worker_spec(cfg, factory), cfg.log_level, on_ready=_on_ready, **supervisor_kwargs)
    stats = ServerStats()
    frontend = Frontend(supervisor, tokenizer, max_seq_len=cfg.max_seq_len, vocab_size=cfg.vocab_size,
                        default_max_tokens=cfg.max_output_tokens, sampling_defaults=defaults, stats=stats)
    return Server(cfg, supervisor, frontend, stats)


def _param(loc: tuple) -> str | None:
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first invalid field as an OpenAI error. The errors of one field (one per member of a
    union type) share its location; their common prefix is the field."""
    errors = exc.errors() or [{"msg": "invalid request", "loc": (), "type": ""}]
    err = errors[0]
    kind, loc = err.get("type", ""), tuple(err.get("loc", ()))
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", err.get("msg"))
        return ApiError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")
    same_field = [tuple(e.get("loc", ())) for e in errors if tuple(e.get("loc", ()))[:2] == loc[:2]]
    if len(same_field) > 1:
        loc = os.path.commonprefix(same_field)
    param = _param(loc)
    if param is None and kind in ("missing", "model_attributes_type", "dict_type"):
        return ApiError(400, "the request body must be a JSON object (and sent as Content-Type: "
                             "application/json)", code="invalid_json")
    if kind == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    code = "invalid_type" if kind.endswith(("_type", "_parsing")) or len(same_field) > 1 else "invalid_value"
    return ApiError(400, f"{param or 'body'}: {err.get('msg')}", param=param, code=code)


def api_error_response(path: str, e: ApiError):
    """The error in the shape of the API the path belongs to (Anthropic's under /v1/messages)."""
    if path.startswith("/v1/messages"):
        return anthropic_api.error_response(e)
    return error_response(e)


class BodyLimit:
    """ASGI middleware: refuse request bodies over `limit` bytes, so no client can exhaust memory."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = ApiError(413, f"the request body is over {self.limit} bytes", code="request_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await api_error_response(scope.get("path", ""), too_large)(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # a chunked body without Content-Length
                    raise too_large
            return message

        await self.app(scope, limited_receive, send)


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.supervisor.start()
        try:
            yield
        finally:
            log.info("shutting down the engine worker")
            server.supervisor.stop()

    app = FastAPI(title="moeferry", version=__version__, lifespan=lifespan)
    app.state.server = server
    app.state.metrics = metrics.registry_for(server)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        if exc.status >= 500:
            log.warning("%s %s -> %d %s", request.method, request.url.path, exc.status, exc.message)
        return api_error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return api_error_response(request.url.path, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return api_error_response(request.url.path, ApiError(exc.status_code, str(exc.detail),
                                                             "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return api_error_response(request.url.path, ApiError(
            500, f"internal server error: {type(exc).__name__}: {exc}", "server_error", code="internal_error"))

    app.add_middleware(BodyLimit)
    add_access_control(app, server.cfg.api_key, server.cfg.cors_origins, api_error_response)
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(tokens_api.router)
    app.include_router(control.router)
    app.include_router(metrics.router)
    return app


def serve(cfg: ServeConfig) -> int:
    """Run the server until a shutdown signal."""
    import uvicorn

    log.info("moeferry serve: resolved configuration\n%s", cfg.table())
    server = build_server(cfg)
    app = create_app(server)
    uv = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None,
                                       log_level=cfg.log_level, timeout_graceful_shutdown=5))
    try:
        uv.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it already shut down on
        pass
    return 0
