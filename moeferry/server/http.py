"""uvicorn as this server runs it: connections cannot be held open for free, and a shutdown
signal ends running requests with an error rather than cutting them.

- `HeaderTimeoutProtocol`: uvicorn's h11 protocol closes a connection whose request headers are
  not complete `HEADER_TIMEOUT_S` after it opened (or after its last response). uvicorn itself
  waits forever for them, so a client sending partial headers holds a connection for good.
  An idle keep-alive connection is closed after `KEEP_ALIVE_S` (uvicorn's keep-alive timeout).
- `HttpServer.handle_exit` (SIGINT/SIGTERM): before uvicorn's graceful shutdown, `on_exit` runs in a
  thread (the supervisor's drain), so requests still running get an error response or error event.
"""
from __future__ import annotations

import threading
from typing import Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5.0
GRACEFUL_SHUTDOWN_S = 5.0


class HeaderTimeoutProtocol(H11Protocol):
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timeout()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timeout()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timeout()
        super().connection_lost(exc)

    def _arm_header_timeout(self) -> None:
        self._cancel_header_timeout()
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._header_timeout)

    def _cancel_header_timeout(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        in_request = self.cycle is not None and not self.cycle.response_complete
        if not in_request and not self.transport.is_closing():
            self.transport.close()  # no complete request line and headers in time


class HttpServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], object]):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            threading.Thread(target=self.on_exit, name="drain", daemon=True).start()
        super().handle_exit(sig, frame)


def http_config(app, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_config=None, log_level=log_level, http=HeaderTimeoutProtocol,
                          timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
