"""The gateway's OpenAI-compatible HTTP front (aiohttp, on the gRPC server's event loop).

``POST /v1/completions``, ``POST /v1/chat/completions`` (whole or streamed as server-sent
events), ``GET /v1/models``, ``GET /health``. Requests go through the same path as gRPC ones
(``GatewayCore.generate``: validation, admission, sessions, metrics, traces); the JSON is
translated at this edge (``gateway/openai_api.py``). API keys are the gRPC API's
(``Authorization: Bearer KEY``); ``/health`` stays open. A client that disconnects cancels its
generation, which frees its sessions on every service.

Every answer that is not a success is in OpenAI's error shape. POST bodies must be JSON
(``Content-Type: application/json`` or ``application/*+json``; anything else is 415, so that a web
page cannot start generations with a form or plain-text POST, which browsers send cross-origin
without a preflight).

Limits (``HttpLimits`` in ``gateway/http_limits.py``, with their defaults; the gateway's
``--http-*`` flags), the connection-level ones held by ``gateway/http_connections.py``:

- ``header_timeout_s``: from a request's first byte to its complete head (else 408, closed);
- ``body_timeout_s``: from the head to the whole body (else 408, closed);
- ``keepalive_timeout_s``: a connection with no request head this long after it opened or after its
  previous response is closed;
- ``max_connections``: a connection opened past it gets 503 and is closed at once;
- ``request_timeout_s``: each request's deadline, passed down the request path as the gRPC front
  passes its client's. A client may ask for another in ``X-Request-Timeout: SECONDS``, at most
  ``max_request_timeout_s``. Past it the request ends with 504 (the stream's last event once it
  began; a client that does not read that either is cut off);
- bodies past ``--max-message-bytes`` are 413; aiohttp refuses heads with a line over 8190 bytes or
  more than 128 headers (400).

What a public deployment still wants in front (an ingress or load balancer): TLS handshakes here
are asyncio's (not timed by the head timer, not counted against the cap until done), and there is
no limit per client address nor any rate limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import ssl
import time

from aiohttp import web

from specdec.rpc.security import key_is_valid, presented_key, tenant_of
from specdec.rpc.server import ServeOptions
from specdec.telemetry.logs import printable

from gateway import openai_api
from gateway.generation import Finished, GatewayCore
from gateway.http_connections import LimitedAppRunner
from gateway.http_limits import REQUEST_TIMEOUT_HEADER, HttpLimits
from gateway.openai_api import ApiError

log = logging.getLogger("specdec.gateway.http")

ROUTE_COMPLETIONS = "/v1/completions"
ROUTE_CHAT = "/v1/chat/completions"
ROUTE_MODELS = "/v1/models"
ROUTE_HEALTH = "/health"
OPEN_ROUTES = (ROUTE_HEALTH,)  # no API key needed (probes)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"
REQUEST_ID_HEADER = "X-Request-Id"
# Bodies past this size are decoded off the event loop (as prompts are tokenized), so that one
# large request does not stall every stream.
OFF_LOOP_JSON_BYTES = 64 * 1024
# Once a stream's deadline passed or it failed, its error event gets this long to be written; a
# client that reads nothing meanwhile is cut off.
LAST_EVENT_S = 5.0
# application/json, or a JSON-based type such as application/vnd.api+json (parameters aside).
JSON_MEDIA_TYPE = re.compile(r"application/(?:[\w.-]+\+)?json")


def error_response(error: ApiError, headers: dict | None = None) -> web.Response:
    if error.status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return web.json_response(error.body(), status=error.status, headers=headers)


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _ssl_context(options: ServeOptions) -> ssl.SSLContext | None:
    """HTTPS with the gRPC port's certificate (client certificates required with mTLS)."""
    tls = options.tls
    if tls is None or not tls.enabled:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(tls.cert), str(tls.key))
    if tls.client_auth:
        context.load_verify_locations(str(tls.ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def decode_json(data: bytes):
    """Strict JSON: NaN and Infinity, which Python's decoder takes, are refused."""
    return json.loads(data, parse_constant=_not_json)


class RequestDeadline:
    """A request's deadline, from its head, on the event loop's clock."""

    def __init__(self, seconds: float, max_seconds: float) -> None:
        self.seconds = seconds
        self.max_seconds = max_seconds
        self.at = asyncio.get_running_loop().time() + seconds

    def remaining(self) -> float:
        return self.at - asyncio.get_running_loop().time()

    async def within(self, awaitable):
        """``awaitable``'s result; 504 once the deadline passed (which cancels it: a generation, a
        write to a client that does not read)."""
        try:
            async with asyncio.timeout_at(self.at):
                return await awaitable
        except TimeoutError:
            raise openai_api.DeadlineExceeded(
                f"the request's deadline passed ({self.seconds:g} s; {REQUEST_TIMEOUT_HEADER} may ask for up to "
                f"{self.max_seconds:g})") from None


class HttpFront:
    def __init__(self, core: GatewayCore, options: ServeOptions, limits: HttpLimits | None = None) -> None:
        self.core = core
        self.limits = limits or HttpLimits()
        self.api_keys = list(options.api_keys)
        self.tls = _ssl_context(options)
        self.created = int(time.time())
        self.draining = False
        app = web.Application(client_max_size=options.max_message_bytes, middlewares=[self._guard])
        app.router.add_post(ROUTE_COMPLETIONS, self.completions)
        app.router.add_post(ROUTE_CHAT, self.chat_completions)
        app.router.add_get(ROUTE_MODELS, self.models)
        app.router.add_get(ROUTE_MODELS + "/{model:.+}", self.model)
        app.router.add_get(ROUTE_HEALTH, self.health)
        # handler_cancellation: a client that disconnects cancels its handler (and so its generation).
        self.runner = LimitedAppRunner(app, self.limits, handler_cancellation=True,
                                       shutdown_timeout=options.grace_s, access_log=None)
        self.closed = False

    async def start(self, host: str, port: int) -> int:
        await self.runner.setup()
        try:
            await web.TCPSite(self.runner, host, port, ssl_context=self.tls).start()
        except OSError as exc:
            await self.close()
            raise SystemExit(f"gateway: cannot listen on {host}:{port} for HTTP (in use?): {exc}") from exc
        return port

    async def drain_after(self, stop_requested) -> None:
        """Once ``stop_requested`` returns: unready, stop listening, let in-flight requests finish
        within the grace period, then cancel what is left."""
        await stop_requested
        self.draining = True
        await self.close()

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.runner.cleanup()

    # -- middleware: API keys, and every error in OpenAI's shape -----------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler):
        if self.api_keys and request.path not in OPEN_ROUTES:
            header_pairs = [(name.lower(), value) for name, value in request.headers.items()]
            if not key_is_valid(presented_key(header_pairs), self.api_keys):
                given = "authorization" in request.headers or "x-api-key" in request.headers
                return error_response(ApiError(
                    401, "invalid API key" if given else "missing API key (send Authorization: Bearer KEY)",
                    code="invalid_api_key"))
        try:
            return await handler(request)
        except web.HTTPException as exc:  # unknown route, wrong method, body over the size limit
            if exc.status < 400:
                raise
            return error_response(ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}",
                                           type="invalid_request_error"))
        except Exception:  # a bug here: the traceback is what fixes it; the client gets OpenAI's shape
            log.exception("internal error in %s %s", printable(request.method), printable(request.path))
            return error_response(ApiError(500, "internal error in the gateway", "server_error"))

    # -- routes ------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        serving = self.core.serving and not self.draining
        return web.json_response({"status": "serving" if serving else "not_serving"}, status=200 if serving else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(openai_api.models_list(self.core.model_name, self.created))

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.core.model_name:
            return error_response(ApiError(404, f"model {request.match_info['model']!r} is not served here",
                                           param="model", code="model_not_found"))
        return web.json_response(openai_api.model_object(self.core.model_name, self.created))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, openai_api.COMPLETION, ROUTE_COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, openai_api.CHAT, ROUTE_CHAT)

    def _timeout_s(self, request: web.Request) -> float:
        """The request's deadline in seconds: the client's ``X-Request-Timeout`` within the maximum."""
        asked = request.headers.get(REQUEST_TIMEOUT_HEADER)
        if asked is None:
            return self.limits.request_timeout(None)
        try:
            seconds = float(asked)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise ApiError(400, f"{REQUEST_TIMEOUT_HEADER}: must be a positive number of seconds",
                           param=REQUEST_TIMEOUT_HEADER)
        return self.limits.request_timeout(seconds)

    async def _body(self, request: web.Request):
        if not JSON_MEDIA_TYPE.fullmatch(request.content_type):
            raise ApiError(415, f"Content-Type must be application/json, not {request.content_type[:100]}",
                           code="unsupported_media_type")
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                data = await request.read()  # HTTPRequestEntityTooLarge past client_max_size
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                           code="request_timeout") from None
        try:
            if len(data) > OFF_LOOP_JSON_BYTES:
                return await self.core.off_loop(decode_json, data)
            return decode_json(data)
        except ValueError as exc:  # not JSON, or not UTF-8
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
        except RecursionError:
            raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None

    async def _refuse(self, request: web.Request, error: ApiError) -> web.StreamResponse:
        """A request refused before its generation; a client too slow with its body loses the connection."""
        if error.status != 408:
            self.core.rejected_invalid()
            return error_response(error)
        response = error_response(error)
        response.force_close()
        with contextlib.suppress(ConnectionResetError):
            await response.prepare(request)
            await response.write_eof()
        request.protocol.force_close()  # not aiohttp's lingering read of the rest of a trickled body
        return response

    async def _generate(self, request: web.Request, kind: str, route: str) -> web.StreamResponse:
        core = self.core
        try:
            deadline = RequestDeadline(self._timeout_s(request), self.limits.max_request_timeout_s)
            api = openai_api.parse_request(await self._body(request), kind, core.model_name,
                                           openai_api.response_id(kind))
        except ApiError as error:
            return await self._refuse(request, error)
        request_id = api.generation.request_id
        api.generation.tenant = tenant_of(presented_key([(name.lower(), value) for name, value in request.headers.items()]),
                                          bool(self.api_keys))
        headers = {REQUEST_ID_HEADER: request_id}  # as OpenAI's: the id a refusal can be traced by
        obs = core.request_telemetry(api.generation, {"http.request.method": request.method, "http.route": route,
                                                      "url.scheme": "https" if self.tls else "http",
                                                      "specdec.request_id": request_id})
        status = None  # the response's status once decided (a client that went away gets none)
        try:
            # The deadline goes down the request path as the gRPC front's client's does.
            async with contextlib.aclosing(core.generate(api.generation, obs, deadline.remaining)) as events:
                writer = openai_api.ResponseWriter(api, core.model_name)
                text, token_ids = [], []
                try:
                    event = await deadline.within(anext(events))  # errors before the first token get their status
                    if api.stream:
                        status = 200
                        return await self._stream(request, writer, event, events, deadline, obs, route, headers)
                    while not isinstance(event, Finished):
                        text.append(event.text)
                        token_ids.extend(event.token_ids)
                        event = await deadline.within(anext(events))
                except Exception as exc:  # noqa: BLE001 - the request path's errors, mapped in one place
                    obs.fail(exc)
                    error = self._error(exc, api, route)
                    status = error.status
                    return error_response(error, headers)
                # Sent before the sessions close (leaving this block), not after.
                response = web.json_response(writer.whole("".join(text), token_ids, event), headers=headers)
                status = 200
                with contextlib.suppress(ConnectionResetError):  # the client went away at the last moment
                    await response.prepare(request)
                    await response.write_eof()
                return response
        except BaseException as exc:  # cancelled: the client went away
            obs.fail(exc)
            raise
        finally:
            if status is not None:
                obs.set_attributes({"http.response.status_code": status})
            obs.end()

    async def _stream(self, request: web.Request, writer: openai_api.ResponseWriter, first, events,
                      deadline: RequestDeadline, obs, route: str, headers: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await response.prepare(request)
        event = first
        try:
            while not isinstance(event, Finished):
                await deadline.within(response.write(sse(writer.chunk(event))))
                event = await deadline.within(anext(events))
            for chunk in writer.final_chunks(event):
                await deadline.within(response.write(sse(chunk)))
            await deadline.within(response.write(SSE_DONE))
            await deadline.within(response.write_eof())
            return response
        except ConnectionResetError as exc:  # the client went away between two writes
            obs.fail(exc)
            return response
        except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in the stream
            obs.fail(exc)
            error = self._error(exc, writer.request, route)
        try:
            async with asyncio.timeout(LAST_EVENT_S):
                await response.write(sse(error.body()))
                await response.write_eof()
        except ConnectionResetError:
            pass
        except TimeoutError:  # a client that reads nothing
            if request.transport is not None:
                request.transport.abort()
        return response

    def _error(self, exc: BaseException, api: openai_api.ApiRequest, route: str) -> ApiError:
        error = openai_api.error_for(exc, api.names)
        if error.status >= 500 and error.code is None:  # a bug here: the traceback is what fixes it
            log.error("internal error in %s", route, exc_info=exc)
        return error
