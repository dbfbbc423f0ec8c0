"""Who may call the server: an API key (--api-key) and the browser origins allowed (--cors-origins).

The key is accepted as `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY`
(Anthropic clients) and compared in constant time. /health stays open for load balancers and
supervisors, and CORS preflights (OPTIONS) are answered before the key is asked for, as
browsers send them without credentials.
"""
from __future__ import annotations

import hmac

from starlette.middleware.cors import CORSMiddleware

from moeferry.server.protocol import ApiError

OPEN_PATHS = frozenset({"/health"})


def presented_keys(headers: dict[bytes, bytes]) -> list[bytes]:
    out = []
    auth = headers.get(b"authorization", b"")
    scheme, _, token = auth.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        out.append(token.strip())
    if headers.get(b"x-api-key"):
        out.append(headers[b"x-api-key"].strip())
    return out


class ApiKeyAuth:
    """ASGI middleware: 401 unless the request carries the key."""

    def __init__(self, app, key: str, error_response):
        self.app, self.key, self.error_response = app, key.encode(), error_response

    def allowed(self, headers: dict[bytes, bytes]) -> bool:
        # compare every presented key (no early exit on the first header) in constant time
        ok = False
        for k in presented_keys(headers):
            ok |= hmac.compare_digest(k, self.key)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.allowed(headers):
            return await self.app(scope, receive, send)
        given = bool(presented_keys(headers))
        err = ApiError(401, "Incorrect API key provided" if given else
                       "Missing API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                       "invalid_request_error", None, "invalid_api_key")
        response = self.error_response(scope["path"], err)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def add_access_control(app, api_key: str | None, cors_origins: tuple[str, ...], error_response) -> None:
    """Install the key check, then CORS outside it (Starlette runs the last added first)."""
    if api_key:
        app.add_middleware(ApiKeyAuth, key=api_key, error_response=error_response)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in cors_origins, max_age=600)
