"""The gateway's OpenAI-compatible HTTP front (aiohttp, on the gRPC server's event loop).

``POST /v1/completions``, ``POST /v1/chat/completions`` (whole or streamed as server-sent
events), ``GET /v1/models``, ``GET /health``. Requests go through the same path as gRPC ones
(``GatewayCore.generate``: validation, admission, sessions, metrics, traces); the JSON is
translated at this edge (``gateway/openai_api.py``). API keys are the gRPC API's
(``Authorization: Bearer KEY``); ``/health`` stays open. A client that disconnects cancels its
generation, which frees its sessions on every service.
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
import time

from aiohttp import web

from specdec.rpc.security import key_is_valid, presented_key
from specdec.rpc.server import ServeOptions

from gateway import openai_api
from gateway.generation import Finished, GatewayCore
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


class HttpFront:
    def __init__(self, core: GatewayCore, options: ServeOptions) -> None:
        self.core = core
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
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=options.grace_s,
                                    access_log=None)
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

    async def _body(self, request: web.Request):
        data = await request.read()  # HTTPRequestEntityTooLarge past client_max_size
        try:
            if len(data) > OFF_LOOP_JSON_BYTES:
                return await self.core.off_loop(json.loads, data)
            return json.loads(data)
        except ValueError as exc:  # not JSON, or not UTF-8
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc

    async def _generate(self, request: web.Request, kind: str, route: str) -> web.StreamResponse:
        core = self.core
        try:
            api = openai_api.parse_request(await self._body(request), kind, core.model_name,
                                           openai_api.response_id(kind))
        except ApiError as error:
            core.rejected_invalid()
            return error_response(error)
        request_id = api.generation.request_id
        headers = {REQUEST_ID_HEADER: request_id}  # as OpenAI's: the id a refusal can be traced by
        obs = core.request_telemetry(api.generation, {"http.request.method": request.method, "http.route": route,
                                                      "url.scheme": "https" if self.tls else "http",
                                                      "specdec.request_id": request_id})
        status = None  # the response's status once decided (a client that went away gets none)
        try:
            async with contextlib.aclosing(core.generate(api.generation, obs)) as events:
                writer = openai_api.ResponseWriter(api, core.model_name)
                text, token_ids = [], []
                try:
                    event = await anext(events)  # errors before the first token get their status
                    if api.stream:
                        status = 200
                        return await self._stream(request, writer, event, events, obs, route, headers)
                    while not isinstance(event, Finished):
                        text.append(event.text)
                        token_ids.extend(event.token_ids)
                        event = await anext(events)
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

    async def _stream(self, request: web.Request, writer: openai_api.ResponseWriter, first, events, obs,
                      route: str, headers: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await response.prepare(request)
        event = first
        try:
            while not isinstance(event, Finished):
                await response.write(sse(writer.chunk(event)))
                event = await anext(events)
            for chunk in writer.final_chunks(event):
                await response.write(sse(chunk))
            await response.write(SSE_DONE)
        except ConnectionResetError as exc:  # the client went away between two writes
            obs.fail(exc)
            return response
        except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in the stream
            obs.fail(exc)
            error = self._error(exc, writer.request, route)
            with contextlib.suppress(ConnectionResetError):
                await response.write(sse(error.body()))
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    def _error(self, exc: BaseException, api: openai_api.ApiRequest, route: str) -> ApiError:
        error = openai_api.error_for(exc, api.names)
        if error.status >= 500 and error.code is None:  # a bug here: the traceback is what fixes it
            log.error("internal error in %s", route, exc_info=exc)
        return error
