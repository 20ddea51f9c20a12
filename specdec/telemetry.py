"""Tracing and metrics for the specdec services, in one place.

Configured from the standard OpenTelemetry environment (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``..._METRICS_ENDPOINT``, ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER[_ARG]``, ``OTEL_BSP_*``,
``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_PROPAGATORS``, ``OTEL_SDK_DISABLED``,
``OTEL_TRACES_EXPORTER=none`` / ``OTEL_METRICS_EXPORTER=none``) and the serve flags
``--otlp-endpoint`` and ``--trace-detail {request,round}`` (default ``$SPECDEC_TRACE_DETAIL`` or
``request``). Spans go out over OTLP/gRPC through a BatchSpanProcessor, metrics through a periodic
OTLP/gRPC reader. With no endpoint configured nothing is installed and nothing is imported from
the SDK: every hook below is a ``None`` check.

What is traced (see docs/observability.md for a captured example):

- gateway: one SERVER span per ``Generate`` named ``{gen_ai.operation.name} {gen_ai.request.model}``
  with the GenAI request/usage/response attributes and ``specdec.*`` speculation figures; the
  prefill and every round as span events (detail ``request``) or child spans (detail ``round``),
  with k, accepted count and the time in draft, verify and network;
- drafter / verifier: one SERVER span per ``Draft`` / ``Verify`` stream, a child of the gateway's
  request span through W3C trace context in the stream's gRPC metadata, with per-session counts; at
  detail ``round`` also a child span per prefill / propose / verify.

Spans per request are bounded: at most ``MAX_ROUND_SPANS`` round events or child spans per service,
the rest only summed into the parent span's attributes (``specdec.trace.rounds_dropped``).

Metrics (OpenTelemetry name / Prometheus name on the service's ``--metrics-port``):
``gen_ai.server.time_to_first_token`` / ``gen_ai_server_time_to_first_token_seconds``,
``gen_ai.server.time_per_output_token`` / ``gen_ai_server_time_per_output_token_seconds``,
``gen_ai.server.request.duration`` / ``gen_ai_server_request_duration_seconds``,
``specdec.acceptance_rate`` / ``specdec_acceptance_rate`` (per request),
``specdec.accepted_length`` / ``specdec_accepted_length`` (tokens committed per round),
``specdec.draft_length`` / ``specdec_draft_length`` (k chosen per round),
``specdec.position.drafted|accepted`` / ``specdec_position_drafted|accepted_total`` (per-position
acceptance = accepted / drafted), ``specdec.active_sessions`` / ``specdec_active_sessions``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("specdec.telemetry")

DETAILS = ("request", "round")
DETAIL_ENV = "SPECDEC_TRACE_DETAIL"
MAX_ROUND_SPANS = 64  # round events / child spans per request and service; the rest are summed
# Upper bound on the spans of one request across the three services (request span + prefill +
# rounds on the gateway; stream span + steps on the drafter and on the verifier).
MAX_SPANS_PER_REQUEST = (2 + MAX_ROUND_SPANS) + 2 * (1 + MAX_ROUND_SPANS)

# Bucket boundaries advised by the GenAI semantic conventions.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)


class Telemetry:
    """What ``setup()`` installed. The default (nothing configured) has no tracer and no meter."""

    def __init__(self, service_name: str = "specdec", detail: str = "request") -> None:
        self.service_name = service_name
        self.detail = detail
        self.tracer = None
        self.meter = None
        self._providers: list = []
        self._propagate = None

    @property
    def tracing(self) -> bool:
        return self.tracer is not None

    @property
    def round_detail(self) -> bool:
        return self.detail == "round"

    # -- W3C trace context in gRPC metadata -------------------------------------------------------
    def outgoing_metadata(self, span) -> tuple[tuple[str, str], ...] | None:
        """``traceparent`` (and ``tracestate``/``baggage``) for a downstream call made under ``span``."""
        if span is None:
            return None
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self._propagate.inject(carrier, context=trace.set_span_in_context(span))
        return tuple(carrier.items())

    def incoming_context(self, grpc_context):
        """The caller's trace context from a server call's invocation metadata."""
        carrier = {}
        for item in grpc_context.invocation_metadata() or ():
            key, value = item[0], item[1]
            if isinstance(value, str):
                carrier[key.lower()] = value
        return self._propagate.extract(carrier)

    # -- spans ---------------------------------------------------------------------------------
    def session_trace(self, grpc_context, service: str, method: str, role: str) -> SessionTrace | None:
        """A drafter or verifier stream's span (``None`` when tracing is off)."""
        if self.tracer is None:
            return None
        from opentelemetry.trace import SpanKind

        span = self.tracer.start_span(
            f"{service}/{method}",
            context=self.incoming_context(grpc_context),
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, "specdec.role": role},
        )
        return SessionTrace(self, span, role)

    # -- metrics -------------------------------------------------------------------------------
    def observe_active_sessions(self, role: str, count: Callable[[], int]) -> None:
        """Export ``specdec.active_sessions`` over OTLP (Prometheus has ``specdec_active_sessions``)."""
        if self.meter is None:
            return
        from opentelemetry.metrics import Observation

        self.meter.create_observable_up_down_counter(
            "specdec.active_sessions", callbacks=[lambda _options: [Observation(count(), {"role": role})]],
            unit="{session}", description="Generation sessions holding state on this service",
        )

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush and stop the exporters (the services call this on exit), within ``timeout_s``: an
        unreachable collector must not hold up a drain; what is left then is dropped."""
        providers, self._providers = self._providers, []
        if not providers:
            return

        def flush() -> None:
            for provider in providers:  # traces first
                try:
                    provider.shutdown()  # exports what is batched
                except Exception:  # noqa: BLE001 - telemetry never fails a shutdown
                    log.warning("telemetry shutdown failed", exc_info=True)

        thread = threading.Thread(target=flush, name="telemetry-shutdown", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("telemetry: exporters did not finish within %.0f s; dropping the rest", timeout_s)


_current = Telemetry()


def current() -> Telemetry:
    return _current


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def setup(service_name: str, endpoint: str | None = None, detail: str | None = None) -> Telemetry:
    """Install OTLP/gRPC exporters if an endpoint is configured (flag or environment); else no-op.

    ``service_name`` is the default ``service.name``; ``OTEL_SERVICE_NAME`` or a ``service.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES`` override it. ``endpoint`` (``--otlp-endpoint``) overrides the
    environment's endpoints; without a scheme it means plaintext (``http://``).
    """
    global _current
    detail = detail or _env(DETAIL_ENV) or "request"
    if detail not in DETAILS:
        raise ValueError(f"trace detail must be one of {', '.join(DETAILS)}, not {detail!r}")
    tel = Telemetry(service_name, detail)
    _current = tel
    if (_env("OTEL_SDK_DISABLED") or "").lower() == "true":
        return tel
    if endpoint and "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    general = _env("OTEL_EXPORTER_OTLP_ENDPOINT")
    traces_at = endpoint or _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or general
    metrics_at = endpoint or _env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or general
    if (_env("OTEL_TRACES_EXPORTER") or "otlp").lower() == "none":
        traces_at = None
    if (_env("OTEL_METRICS_EXPORTER") or "otlp").lower() == "none":
        metrics_at = None
    if not traces_at and not metrics_at:
        return tel

    from opentelemetry import propagate
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    from specdec import __version__

    resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    tel.service_name = str(resource.attributes[SERVICE_NAME])
    tel._propagate = propagate  # OTEL_PROPAGATORS, default W3C tracecontext + baggage
    if traces_at:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # sampler from OTEL_TRACES_SAMPLER[_ARG]
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_at)))  # OTEL_BSP_*
        tel.tracer = provider.get_tracer("specdec", __version__)
        tel._providers.append(provider)
    if metrics_at:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=metrics_at))  # OTEL_METRIC_EXPORT_*
        provider = MeterProvider(resource=resource, metric_readers=[reader], shutdown_on_exit=False)
        tel.meter = provider.get_meter("specdec", __version__)
        tel._providers.append(provider)
    log.info("telemetry: service.name=%s traces=%s metrics=%s detail=%s",
             tel.service_name, traces_at or "off", metrics_at or "off", detail)
    return tel


def shutdown() -> None:
    _current.shutdown()


def _epoch_ns(perf_s: float) -> int:
    """A ``time.perf_counter()`` reading as epoch nanoseconds (span timestamps)."""
    return time.time_ns() - int((time.perf_counter() - perf_s) * 1e9)


def _error_type(exc: BaseException) -> str:
    import asyncio

    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    code = getattr(exc, "code", None)
    if callable(code):  # grpc.aio.AioRpcError from downstream
        try:
            return str(code().name)
        except Exception:  # noqa: BLE001
            pass
    return type(exc).__name__


def _mark_failed(span, exc: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    error_type = _error_type(exc)
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, str(exc) or error_type))


class SessionTrace:
    """A drafter or verifier stream: one span, and at detail ``round`` one child span per step
    (prefill / propose / verify), at most ``MAX_ROUND_SPANS``; counts summed onto the stream span."""

    def __init__(self, tel: Telemetry, span, role: str) -> None:
        self.tel = tel
        self.span = span
        self.role = role
        self.steps = 0
        self.dropped = 0
        self.totals: dict[str, float] = {}

    def set(self, **attributes) -> None:
        for key, value in attributes.items():
            self.span.set_attribute(f"specdec.{key}", value)

    def step(self, name: str, started: float, **counts: int) -> None:
        """A finished step that began at ``started`` (``time.perf_counter()``)."""
        elapsed = time.perf_counter() - started
        totals = self.totals
        totals[f"{name}.count"] = totals.get(f"{name}.count", 0) + 1
        totals[f"{name}.time_s"] = totals.get(f"{name}.time_s", 0.0) + elapsed
        for key, value in counts.items():
            if key != "round":
                totals[f"{name}.{key}"] = totals.get(f"{name}.{key}", 0) + value
        if not self.tel.round_detail:
            return
        if self.steps >= MAX_ROUND_SPANS:
            self.dropped += 1
            return
        self.steps += 1
        from opentelemetry import trace

        end_ns = time.time_ns()
        child = self.tel.tracer.start_span(
            f"specdec.{self.role}.{name}",
            context=trace.set_span_in_context(self.span),
            start_time=end_ns - int(elapsed * 1e9),
            attributes={f"specdec.{k}": v for k, v in counts.items()},
        )
        child.end(end_time=end_ns)

    def fail(self, exc: BaseException) -> None:
        _mark_failed(self.span, exc)

    def end(self) -> None:
        for key, value in self.totals.items():
            self.span.set_attribute(f"specdec.{key}", value)
        self.span.set_attribute("specdec.trace.rounds_dropped", self.dropped)
        self.span.end()


class GenAIMetrics:
    """The gateway's request-level metrics, in Prometheus (``registry``) and, when configured, OTLP."""

    def __init__(self, registry, tel: Telemetry | None = None) -> None:
        from prometheus_client import Counter, Histogram

        genai = ["gen_ai_operation_name", "gen_ai_request_model"]
        self.p_ttft = Histogram("gen_ai_server_time_to_first_token_seconds", "Time to first token (gateway)",
                                genai, buckets=TTFT_BUCKETS, registry=registry)
        self.p_tpot = Histogram("gen_ai_server_time_per_output_token_seconds", "Time per output token after the first",
                                genai, buckets=TPOT_BUCKETS, registry=registry)
        self.p_duration = Histogram("gen_ai_server_request_duration_seconds", "Generate duration",
                                    genai + ["error_type"], buckets=DURATION_BUCKETS, registry=registry)
        method = ["specdec_draft_method"]
        self.p_rate = Histogram("specdec_acceptance_rate", "Accepted / drafted tokens per request",
                                method, buckets=RATE_BUCKETS, registry=registry)
        self.p_length = Histogram("specdec_accepted_length", "Tokens committed per verification round",
                                  method, buckets=LENGTH_BUCKETS, registry=registry)
        self.p_k = Histogram("specdec_draft_length", "Draft length k chosen per round",
                             method, buckets=LENGTH_BUCKETS, registry=registry)
        self.p_pos_drafted = Counter("specdec_position_drafted", "Drafts verified at each position of a block",
                                     method + ["specdec_position"], registry=registry)
        self.p_pos_accepted = Counter("specdec_position_accepted", "Drafts accepted at each position of a block",
                                      method + ["specdec_position"], registry=registry)
        self.otel = None
        meter = tel.meter if tel is not None else None
        if meter is not None:
            h = meter.create_histogram
            self.otel = {
                "ttft": h("gen_ai.server.time_to_first_token", "s", "Time to first token (gateway)",
                          explicit_bucket_boundaries_advisory=TTFT_BUCKETS),
                "tpot": h("gen_ai.server.time_per_output_token", "s", "Time per output token after the first",
                          explicit_bucket_boundaries_advisory=TPOT_BUCKETS),
                "duration": h("gen_ai.server.request.duration", "s", "Generate duration",
                              explicit_bucket_boundaries_advisory=DURATION_BUCKETS),
                "rate": h("specdec.acceptance_rate", "1", "Accepted / drafted tokens per request",
                          explicit_bucket_boundaries_advisory=RATE_BUCKETS),
                "length": h("specdec.accepted_length", "{token}", "Tokens committed per verification round",
                            explicit_bucket_boundaries_advisory=LENGTH_BUCKETS),
                "k": h("specdec.draft_length", "{token}", "Draft length k chosen per round",
                       explicit_bucket_boundaries_advisory=LENGTH_BUCKETS),
                "pos_drafted": meter.create_counter("specdec.position.drafted", "{token}",
                                                    "Drafts verified at each position of a block"),
                "pos_accepted": meter.create_counter("specdec.position.accepted", "{token}",
                                                     "Drafts accepted at each position of a block"),
            }

    def round(self, method: str, k: int, emitted: int) -> None:
        self.p_length.labels(method).observe(emitted)
        self.p_k.labels(method).observe(k)
        if self.otel is not None:
            attrs = {"specdec.draft.method": method}
            self.otel["length"].record(emitted, attrs)
            self.otel["k"].record(k, attrs)

    def request(self, operation: str, model: str, method: str, duration_s: float, error_type: str = "",
                ttft_s: float | None = None, tpot_s: float | None = None, stats=None) -> None:
        self.p_duration.labels(operation, model, error_type).observe(duration_s)
        genai = {"gen_ai.operation.name": operation, "gen_ai.request.model": model}
        if self.otel is not None:
            self.otel["duration"].record(duration_s, {**genai, "error.type": error_type} if error_type else genai)
        if ttft_s is not None:
            self.p_ttft.labels(operation, model).observe(ttft_s)
            if self.otel is not None:
                self.otel["ttft"].record(ttft_s, genai)
        if tpot_s is not None:
            self.p_tpot.labels(operation, model).observe(tpot_s)
            if self.otel is not None:
                self.otel["tpot"].record(tpot_s, genai)
        if stats is None or not stats.draft_tokens:
            return
        self.p_rate.labels(method).observe(stats.acceptance_rate)
        for position, (drafted, accepted) in enumerate(zip(stats.per_position_drafted, stats.per_position_accepted)):
            self.p_pos_drafted.labels(method, str(position)).inc(drafted)
            self.p_pos_accepted.labels(method, str(position)).inc(accepted)
        if self.otel is not None:
            self.otel["rate"].record(stats.acceptance_rate, {"specdec.draft.method": method})
            for position, (drafted, accepted) in enumerate(zip(stats.per_position_drafted, stats.per_position_accepted)):
                attrs = {"specdec.draft.method": method, "specdec.position": position}
                self.otel["pos_drafted"].add(drafted, attrs)
                self.otel["pos_accepted"].add(accepted, attrs)


class RequestTelemetry:
    """One gateway ``Generate``: its span (when tracing), round events or spans, and its metrics.

    Lifecycle: ``begin()`` once the request is validated, ``metadata()`` for the downstream streams,
    ``on_round`` as the loop's observer, ``finish(result)`` with the final result, then ``end()``
    (``fail(exc)`` first on an error or cancel).
    """

    def __init__(self, tel: Telemetry, metrics: GenAIMetrics, operation: str, model: str) -> None:
        self.tel = tel
        self.metrics = metrics
        self.operation = operation
        self.model = model
        self.method = "none"
        self.started = time.perf_counter()
        self.generate_started = self.started
        self.error_type = ""
        self.result = None
        self.span = None  # recording span, or None (tracing off or sampled out)
        self._context_span = None  # what goes downstream, sampled out or not
        self.verifier = None
        self.drafter = None
        self._verifier_service = 0.0
        self._drafter_service = 0.0
        self.network_s = 0.0
        self.draft_service_s = 0.0
        self.verify_service_s = 0.0
        self.recorded = 0
        self.dropped = 0
        if tel.tracer is not None:
            from opentelemetry.trace import SpanKind

            span = tel.tracer.start_span(
                f"{operation} {model}", kind=SpanKind.SERVER,
                attributes={"gen_ai.operation.name": operation, "gen_ai.provider.name": "specdec",
                            "gen_ai.request.model": model, "specdec.trace.detail": tel.detail},
            )
            self._context_span = span
            self.span = span if span.is_recording() else None

    def begin(self, *, request_id: str, params, prompt_tokens: int, method: str, requested_k: int) -> None:
        self.method = method
        if self.span is None:
            return
        attrs = {
            "gen_ai.response.id": request_id,
            "gen_ai.request.max_tokens": params.max_new_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.top_k": params.top_k,
            "gen_ai.usage.input_tokens": prompt_tokens,
            "specdec.request_id": request_id,
            "specdec.draft.method": method,
            "specdec.draft.requested_k": requested_k,
        }
        if params.seed is not None:
            attrs["gen_ai.request.seed"] = params.seed
        if params.stop:
            attrs["gen_ai.request.stop_sequences"] = list(params.stop)
        self.span.set_attributes(attrs)

    def links(self, verifier, drafter, verifier_address: str, drafter_address: str | None,
              draft_model: str | None) -> None:
        """The links whose ``service_s`` (time spent inside the services) separates network time."""
        self.verifier = verifier
        self.drafter = drafter
        if self.span is not None:
            self.span.set_attribute("specdec.verifier.address", verifier_address)
            if drafter_address:
                self.span.set_attribute("specdec.drafter.address", drafter_address)
            if draft_model:
                self.span.set_attribute("specdec.draft.model", draft_model)

    def drafter_opened_at_prefill(self, opened: bool) -> None:
        """False: the drafter session waits for the first proposal (plain decoding expected)."""
        if self.span is not None:
            self.span.set_attribute("specdec.drafter.opened_at_prefill", opened)

    def metadata(self):
        return self.tel.outgoing_metadata(self._context_span)

    def generation_started(self) -> None:
        self.generate_started = time.perf_counter()

    # -- the loop's observer -------------------------------------------------------------------
    def on_round(self, record) -> None:
        self.metrics.round(self.method, record.k, record.emitted)
        if self.span is None:
            return
        # Time inside the services, from their service_time_us; the rest of a round trip is network.
        verifier_service = getattr(self.verifier, "service_s", None)
        verify_service = record.verify_s
        if verifier_service is not None:
            verify_service = min(record.verify_s, verifier_service - self._verifier_service)
            self._verifier_service = verifier_service
        drafter_service = getattr(self.drafter, "service_s", None)
        draft_service = record.draft_s  # an in-process drafter: no network
        if drafter_service is not None:
            draft_service = min(record.draft_s, drafter_service - self._drafter_service)
            self._drafter_service = drafter_service
        network = max(0.0, record.draft_s - draft_service) + max(0.0, record.verify_s - verify_service)
        self.network_s += network
        self.draft_service_s += draft_service
        self.verify_service_s += verify_service
        if self.recorded >= MAX_ROUND_SPANS:
            self.dropped += 1
            return
        self.recorded += 1
        attrs = {
            "specdec.round": record.round,
            "specdec.k": record.k,
            "specdec.drafted": record.drafted,
            "specdec.accepted": record.accepted,
            "specdec.emitted": record.emitted,
            "specdec.draft_s": draft_service,
            "specdec.verify_s": verify_service,
            "specdec.network_s": network,
        }
        self._step("specdec.round", record.started, record.draft_s + record.verify_s, attrs)

    def _step(self, name: str, started: float, elapsed: float, attrs: dict) -> None:
        start_ns = _epoch_ns(started)
        if self.tel.round_detail:
            from opentelemetry import trace

            child = self.tel.tracer.start_span(name, context=trace.set_span_in_context(self.span),
                                               start_time=start_ns, attributes=attrs)
            child.end(end_time=start_ns + int(elapsed * 1e9))
        else:
            self.span.add_event(name, attrs, timestamp=start_ns + int(elapsed * 1e9))

    # -- the end -------------------------------------------------------------------------------
    def finish(self, result) -> None:
        self.result = result
        if self.span is None:
            return
        stats = result.stats
        prefill_service = getattr(self.verifier, "prefill_service_s", None)
        prefill_network = max(0.0, stats.ttft_s - prefill_service) if prefill_service is not None else 0.0
        self._step("specdec.prefill", self.generate_started, stats.ttft_s, {
            "specdec.verify_s": stats.ttft_s - prefill_network, "specdec.network_s": prefill_network})
        self.span.set_attributes({
            "gen_ai.response.model": self.model,
            "gen_ai.response.finish_reasons": [result.finish_reason],
            "gen_ai.usage.output_tokens": len(result.token_ids),
            "specdec.draft.method": stats.draft_method,
            "specdec.rounds": stats.rounds,
            "specdec.draft_tokens": stats.draft_tokens,
            "specdec.accepted_tokens": stats.accepted_tokens,
            "specdec.acceptance_rate": stats.acceptance_rate,
            "specdec.mean_accepted_length": stats.mean_accepted_length,
            "specdec.per_position_acceptance": list(stats.per_position_acceptance),
            "specdec.final_k": stats.k_history[-1] if stats.k_history else 0,
            "specdec.ttft_s": stats.ttft_s,
            "specdec.draft_s": self.draft_service_s,
            "specdec.verify_s": self.verify_service_s,
            "specdec.network_s": self.network_s + prefill_network,
            "specdec.trace.rounds_dropped": self.dropped,
        })

    def fail(self, exc: BaseException) -> None:
        self.error_type = _error_type(exc)
        if self.span is not None:
            _mark_failed(self.span, exc)

    def end(self) -> None:
        try:
            now = time.perf_counter()
            duration = now - self.started
            result = self.result
            if result is not None and not self.error_type:
                ttft = (self.generate_started - self.started) + result.stats.ttft_s
                n = len(result.token_ids)
                tpot = (duration - ttft) / (n - 1) if n > 1 else None
                self.metrics.request(self.operation, self.model, result.stats.draft_method, duration,
                                     ttft_s=ttft, tpot_s=tpot, stats=result.stats)
            else:
                self.metrics.request(self.operation, self.model, self.method, duration,
                                     error_type=self.error_type or "incomplete")
        finally:
            if self.span is not None:
                self.span.end()
