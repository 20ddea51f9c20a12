"""The public Gateway service: its gRPC front (``Generate``: protobuf translated to and from the
request path in ``gateway/generation.py`` at this edge), the OpenAI-compatible HTTP front beside it
on the same event loop (``gateway/http.py``), and ``serve``."""

from __future__ import annotations

import asyncio
import contextlib

from specdec.rpc import convert
from specdec.rpc.server import ServiceRuntime, map_errors
from specdec.rpc.security import presented_key, tenant_of
from specdec.service_config import GatewayConfig
from specdec.tokenizer import load_serving_tokenizer
from specdec.v1 import drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc
from specdec.wire_types import FieldError

from gateway.generation import Finished, GatewayCore, GatewayLimits, GenerationRequest, LinkOptions, new_request_id
from gateway.http import HttpFront
from gateway.pools import ReplicaPool
from gateway.requests import UndecodableRequest, add_gateway_service

__all__ = ["GatewayLimits", "GatewayService", "LinkOptions", "request_from_pb", "serve"]

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
GRPC_SPAN_ATTRIBUTES = {"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": "Generate"}
DRAFT_AHEAD_FROM_PB = {gateway_pb2.DRAFT_AHEAD_MODE_UNSPECIFIED: None, gateway_pb2.DRAFT_AHEAD_MODE_ON: True,
                       gateway_pb2.DRAFT_AHEAD_MODE_OFF: False}


class _ChatMessages:
    """A request's ``messages`` as ``(role, content)`` pairs, read only when iterated: the gateway
    checks their number first (each access to a string field builds a new str)."""

    def __init__(self, messages) -> None:
        self._messages = messages

    def __len__(self) -> int:
        return len(self._messages)

    def __iter__(self):
        return ((message.role, message.content) for message in self._messages)


def request_from_pb(request: gateway_pb2.GenerateRequest) -> GenerationRequest:
    """The gRPC edge of the request path; ``FieldError`` names a field that cannot be translated."""
    speculation = request.speculation
    if speculation.draft_ahead not in DRAFT_AHEAD_FROM_PB:
        raise FieldError("speculation.draft_ahead", f"unknown value {speculation.draft_ahead}")
    return GenerationRequest(
        request_id=request.request_id,
        prompt=request.prompt,
        messages=_ChatMessages(request.messages),
        prompt_token_ids=request.prompt_token_ids,
        sampling=convert.sampling_from_pb(request.sampling, default_max_new_tokens=0, validate=False),
        method=speculation.method,
        num_draft_tokens=speculation.num_draft_tokens,
        draft_ahead=DRAFT_AHEAD_FROM_PB[speculation.draft_ahead],
        cache_scope=speculation.cache_scope,
        auto_methods=tuple(speculation.auto_methods),
    )


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    """``Generate`` over ``GatewayCore.generate``: protobuf in, protobuf out."""

    def __init__(self, core: GatewayCore, keys_checked: bool = False) -> None:
        self.core = core
        self.keys_checked = keys_checked  # the server's interceptor refuses a call without a valid key

    @map_errors
    async def Generate(self, request, context):
        core = self.core
        if isinstance(request, UndecodableRequest):  # bytes that do not parse (see gateway/requests.py)
            core.rejected_invalid()
            raise await core.off_loop(request.explain)
        try:
            generation_request = request_from_pb(request)
        except ValueError:
            core.rejected_invalid()
            raise
        generation_request.tenant = tenant_of(presented_key(context.invocation_metadata()), self.keys_checked)
        request_id = generation_request.request_id = generation_request.request_id or new_request_id()
        obs = core.request_telemetry(generation_request, GRPC_SPAN_ATTRIBUTES)
        try:
            async with contextlib.aclosing(core.generate(generation_request, obs, context.time_remaining)) as events:
                async for event in events:
                    if isinstance(event, Finished):
                        result = event.result
                        yield gateway_pb2.GenerateResponse(
                            request_id=request_id,
                            prompt_token_ids=event.prompt_token_ids,
                            finish_reason=convert.FINISH_REASON_TO_PB[result.finish_reason],
                            usage=gateway_pb2.Usage(prompt_tokens=result.prompt_tokens,
                                                    completion_tokens=len(result.token_ids)),
                            stats=convert.stats_to_pb(result.stats),
                        )
                    else:
                        yield gateway_pb2.GenerateResponse(request_id=request_id, token_ids=event.token_ids,
                                                           text=event.text)
        except BaseException as exc:
            obs.fail(exc)
            raise
        finally:
            obs.end()


async def serve(config: GatewayConfig) -> None:
    """The gRPC front and, with ``config.http_port``, the OpenAI-compatible HTTP API beside it."""
    options = config.serve
    runtime = ServiceRuntime(SERVICE_NAME, options)
    loop = asyncio.get_running_loop()
    tokenizer = await loop.run_in_executor(None, load_serving_tokenizer, config.target)
    verifiers = ReplicaPool("verifier", verifier_pb2_grpc.VerifierStub, options.max_message_bytes, options.tls,
                            options.outbound_service_token)
    drafters = ReplicaPool("drafter", drafter_pb2_grpc.DrafterStub, options.max_message_bytes, options.tls,
                           options.outbound_service_token)
    verifiers.set_addresses(list(config.verifiers))
    drafters.set_addresses(list(config.drafters))
    watchers = []
    if config.discover_verifiers or config.discover_drafters:
        from gateway.discovery import EndpointSliceWatcher, discovery_api

        api = discovery_api()
        namespace = config.namespace or _pod_namespace()
        for service_name, pool in ((config.discover_verifiers, verifiers), (config.discover_drafters, drafters)):
            if service_name:
                # Discovered replicas are pod IPs: their certificates name the Service instead.
                pool.server_name = f"{service_name}.{namespace}.svc"
                watcher = EndpointSliceWatcher(
                    api, namespace, service_name,
                    on_change=lambda addresses, pool=pool: loop.call_soon_threadsafe(pool.set_addresses, addresses),
                )
                watcher.start()
                watchers.append(watcher)
    core = GatewayCore(runtime, tokenizer, config.limits, verifiers, drafters, config.link, config.suffix)
    core.model_name = config.target
    add_gateway_service(GatewayService(core, bool(options.api_keys)), runtime.server)  # Generate with a deserializer that tolerates bad bytes
    port = await runtime.start()
    http_front = None
    if config.http_port is not None:
        http_front = HttpFront(core, options, config.http_limits)
        bound = await http_front.start(options.host, config.http_port)
    runtime.install_signal_handlers()
    http_note = f"; OpenAI-compatible HTTP API on http{'s' if http_front and http_front.tls else ''}://" \
                f"{options.host}:{bound}/v1" if http_front else ""
    print(f"specdec gateway listening on {options.host}:{port}{http_note}", flush=True)
    connector = asyncio.ensure_future(core.connect())
    try:
        drains = [runtime.wait_and_drain()]
        if http_front is not None:  # both fronts drain at once, within the same grace
            drains.append(http_front.drain_after(runtime.stop_requested()))
        await asyncio.gather(*drains)
    finally:
        connector.cancel()
        if http_front is not None:
            await http_front.close()
        for watcher in watchers:
            watcher.stop()


def _pod_namespace() -> str:
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "default"
