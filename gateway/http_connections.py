"""The HTTP front's connections: aiohttp's server with ``HttpLimits`` held per connection.

aiohttp (3.x) bounds only the idle time of a connection (``keepalive_timeout``: from the
connection's start or its previous response until the next complete request head) and answers a
request it cannot parse with a plain-text 400 and a logged traceback. Here each connection is
aiohttp's ``RequestHandler`` with, in addition:

- a head timer: once a request's first byte arrives, its head (request line and headers) must be
  complete within ``header_timeout_s``, else the client gets 408 and the connection is closed (a
  client trickling its head one byte at a time would otherwise hold it for as long as it likes);
- a cap on open connections: one opened while ``max_connections`` are open gets 503 and is closed
  at once, before anything of it is read;
- requests that do not parse (a header past aiohttp's 8190 bytes, too many headers, not HTTP)
  answered 400 in OpenAI's error shape and logged in one line, without a traceback.

``LimitedAppRunner`` is aiohttp's ``AppRunner`` building this server; body and request deadlines
are the handlers' (``gateway/http.py``). The head timer reads three of ``RequestHandler``'s own
attributes (``_waiter``: it waits for a request; ``_messages``; ``_request_count``), as a subclass
does; tests/test_http_edges.py pins the behaviour across aiohttp versions.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from specdec.telemetry.logs import printable

from gateway.http_limits import HttpLimits
from gateway.openai_api import ApiError

log = logging.getLogger("specdec.gateway.http")


def raw_response(error: ApiError) -> bytes:
    """A whole HTTP/1.1 response carrying ``error``, for a connection closed right after it, before
    (or instead of) any request aiohttp parsed."""
    body = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class LimitedConnection(RequestHandler):
    """One connection: aiohttp's protocol, with a head timer, the connection cap and parse errors
    answered in OpenAI's shape."""

    def __init__(self, manager: LimitedServer, *, limits: HttpLimits, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self.limits = limits
        self.server = manager
        self._head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)  # counted by the server
        if self.server.open_connections > self.limits.max_connections:
            self.server.note_refusal()
            self._close_with(ApiError(503, f"the gateway has {self.limits.max_connections} connections open "
                                           "(its limit); retry later", "server_error", code="service_unavailable"))
        else:
            self.server.refusing = False

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # aiohttp's start() awaits ``_waiter`` while it has no request: a byte now begins a head.
        if self._head_timer is None and self._waiter is not None and not self._messages:
            self._head_timer = self._loop.call_later(self.limits.header_timeout_s, self._head_timed_out)
        requests = self._request_count
        super().data_received(data)
        if self._request_count != requests:  # a whole head arrived (or one that does not parse)
            self._cancel_head_timer()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        log.info("HTTP front: closed a connection from %s that sent no whole request head within %g s",
                 printable(self.peername), self.limits.header_timeout_s)
        self._close_with(ApiError(408, f"the request head did not arrive within {self.limits.header_timeout_s:g} s",
                                  code="request_timeout"))

    def _close_with(self, error: ApiError) -> None:
        if self.transport is not None:
            self.transport.write(raw_response(error))  # flushed before the transport closes
        self.force_close()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):  # a failure of a handler: aiohttp's (a bug; its traceback)
            return super().handle_error(request, status, exc, message)
        # Bytes that are not a request aiohttp takes: the client's error, one line (its text escaped).
        log.info("HTTP front: refused a request from %s that does not parse: %s", printable(request.remote),
                 printable(exc.message))
        error = ApiError(exc.code or 400, f"the request does not parse as HTTP: {exc.message}")
        response = web.json_response(error.body(), status=error.status)
        response.force_close()  # the parser cannot go on after an error
        return response


class LimitedServer(Server):
    """aiohttp's low-level server, making ``LimitedConnection``s and counting the open ones."""

    def __init__(self, handler, *, limits: HttpLimits, **kwargs) -> None:
        super().__init__(handler, **kwargs)
        self.limits = limits
        self.open_connections = 0
        self.refusing = False

    def __call__(self) -> LimitedConnection:
        return LimitedConnection(self, loop=self._loop, limits=self.limits, **self._kwargs)

    def connection_made(self, handler, transport) -> None:
        super().connection_made(handler, transport)
        self.open_connections += 1

    def connection_lost(self, handler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self.open_connections -= 1

    def note_refusal(self) -> None:
        """Log once per stretch of refusals, not once per refused connection."""
        if not self.refusing:
            self.refusing = True
            log.warning("HTTP front: %d connections open (the limit): refusing new ones", self.limits.max_connections)


class LimitedAppRunner(web.AppRunner):
    """aiohttp's ``AppRunner`` serving ``app`` over a ``LimitedServer``; other keyword arguments are
    aiohttp's (``RequestHandler``'s)."""

    def __init__(self, app: web.Application, limits: HttpLimits, **kwargs) -> None:
        # A body the handler does not read (a refusal) is drained for at most the body's time.
        super().__init__(app, keepalive_timeout=limits.keepalive_timeout_s, lingering_time=limits.body_timeout_s,
                         **kwargs)
        self.limits = limits

    async def _make_server(self) -> Server:
        plain = await super()._make_server()  # starts the application and freezes it
        return LimitedServer(plain.request_handler, limits=self.limits, request_factory=plain.request_factory,
                             **self._kwargs)
