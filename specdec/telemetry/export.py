"""Setup and export: what ``setup()`` installs from the flags and the OpenTelemetry environment.

Configured from the standard OpenTelemetry environment (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``..._METRICS_ENDPOINT``, ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER[_ARG]``, ``OTEL_BSP_*``,
``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_PROPAGATORS``, ``OTEL_SDK_DISABLED``,
``OTEL_TRACES_EXPORTER=none`` / ``OTEL_METRICS_EXPORTER=none``) and the serve flags
``--otlp-endpoint`` and ``--trace-detail {request,round}`` (default ``$SPECDEC_TRACE_DETAIL`` or
``request``, resolved in ``specdec.service_config``). Spans go out over OTLP/gRPC through a BatchSpanProcessor, metrics through a periodic
OTLP/gRPC reader whose views give the histograms of ``metrics.METRICS`` their buckets. With no
endpoint configured nothing is installed and nothing is imported from the SDK: every hook is a
``None`` check.
"""

from __future__ import annotations

import logging
import os
import threading

from specdec.telemetry import spans
from specdec.telemetry.metrics import metric_views

log = logging.getLogger("specdec.telemetry")

DETAILS = ("request", "round")


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

    def outgoing_metadata(self, span) -> tuple[tuple[str, str], ...] | None:
        """``traceparent`` (and ``tracestate``/``baggage``) for a downstream call made under ``span``."""
        return spans.outgoing_metadata(self, span)

    def incoming_context(self, grpc_context):
        """The caller's trace context from a server call's invocation metadata."""
        return spans.incoming_context(self, grpc_context)

    def session_trace(self, grpc_context, service: str, method: str, role: str) -> spans.SessionTrace | None:
        """A drafter or verifier stream's span (``None`` when tracing is off)."""
        return spans.session_trace(self, grpc_context, service, method, role)

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
    detail = detail or DETAILS[0]
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
        provider = MeterProvider(resource=resource, metric_readers=[reader], views=metric_views(),
                                 shutdown_on_exit=False)
        tel.meter = provider.get_meter("specdec", __version__)
        tel._providers.append(provider)
    log.info("telemetry: service.name=%s traces=%s metrics=%s detail=%s",
             tel.service_name, traces_at or "off", metrics_at or "off", detail)
    return tel


def shutdown() -> None:
    _current.shutdown()
