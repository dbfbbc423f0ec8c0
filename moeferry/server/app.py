"""Wiring: ServeConfig -> tokenizer, supervisor (engine worker), frontend, FastAPI app, uvicorn."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeferry import __version__
from moeferry.config import ServeConfig
from moeferry.server import anthropic_api, control, metrics, openai_api, tokens_api
from moeferry.server.access import add_access_control
from moeferry.server.first_worker import FirstWorker
from moeferry.server.generation import Frontend, model_sampling_defaults
from moeferry.server.heap import release_free_memory
from moeferry.server.messages import Ready, WorkerSpec
from moeferry.server.openai_api import error_response
from moeferry.server.protocol import ApiError
from moeferry.server.stats import ServerStats
from moeferry.server.supervisor import Supervisor

log = logging.getLogger("moeferry.server")

# A body larger than this is refused (413) before it is read: a 131072-token prompt as JSON
# token ids is about 1 MiB.
MAX_BODY_BYTES = 32 * 2**20
BODY_IDLE_TIMEOUT_S = 30.0  # a client that stops sending its body mid-way gets a 408 after this
RELEASE_AFTER_BYTES = 2**20  # after a body this large, give the freed memory back to the OS


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
    supervisor_kwargs.setdefault("stall_timeout_s", cfg.worker_stall_timeout)
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
    """ASGI middleware: read the whole request body before the app sees it, so that

    - a body over `limit` bytes is a 413 whether it announces its length or is sent chunked;
    - a client that stops sending mid-body gets a 408 after `idle_s` instead of holding the request;
    - the memory a large body (and its parsing and tokenizing) took is given back to the OS afterwards.
    """

    def __init__(self, app, limit: int = MAX_BODY_BYTES, idle_s: float = BODY_IDLE_TIMEOUT_S):
        self.app, self.limit, self.idle_s = app, limit, idle_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = ApiError(413, f"the request body is over {self.limit} bytes", code="request_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await api_error_response(scope.get("path", ""), too_large)(scope, receive, send)
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.idle_s)
            except asyncio.TimeoutError:
                return await api_error_response(scope.get("path", ""), ApiError(
                    408, f"no request body data for {self.idle_s:.0f} s", code="request_timeout"))(scope, receive, send)
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:  # a chunked body without Content-Length
                del chunks
                return await api_error_response(scope.get("path", ""), too_large)(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        del chunks

        async def replay():
            return body.pop() if body else await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            if size >= RELEASE_AFTER_BYTES:
                del body
                release_free_memory()


class CatchAll:
    """ASGI middleware: an unexpected exception is a 500 with a reference, never the exception's text,
    and the connection stays usable (Starlette's own handler re-raises, which drops it)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:  # noqa: BLE001 - logged with its reference; the client gets the reference only
            ref = uuid.uuid4().hex[:12]
            log.exception("unexpected error in %s %s (reference %s)", scope.get("method"), scope.get("path"), ref)
            if not started:
                await api_error_response(scope.get("path", ""), ApiError(
                    500, f"internal server error (reference {ref}; the details are in the server log)",
                    "server_error", code="internal_error"))(scope, receive, send)


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

    app.add_middleware(BodyLimit)
    app.add_middleware(CatchAll)
    add_access_control(app, server.cfg.api_key, server.cfg.cors_origins, api_error_response)
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(tokens_api.router)
    app.include_router(control.router)
    app.include_router(metrics.router)
    return app


def serve(cfg: ServeConfig, first_worker: FirstWorker | None = None) -> int:
    """Run the server until a shutdown signal (`first_worker`: the process to boot the engine in,
    started as the command began)."""
    from moeferry.server.http import GRACEFUL_SHUTDOWN_S, HttpServer, http_config

    log.info("moeferry serve: resolved configuration\n%s", cfg.table())
    server = build_server(cfg, first_worker=first_worker)
    app = create_app(server)
    # On a shutdown signal, running requests get a moment to finish, then an error (before uvicorn's
    # graceful shutdown gives up on their connections).
    drain_s = GRACEFUL_SHUTDOWN_S / 2
    uv = HttpServer(http_config(app, cfg.host, cfg.port, cfg.log_level),
                    on_exit=lambda: server.supervisor.drain(drain_s))
    try:
        uv.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it already shut down on
        pass
    finally:
        server.supervisor.stop()  # (done already after a lifespan; not when uvicorn failed before one)
    return 0
