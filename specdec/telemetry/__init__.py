"""Tracing and metrics for the specdec services (docs/observability.md).

- ``export``: ``setup()`` from the serve flags and the OpenTelemetry environment (OTLP/gRPC exporters
  for spans and metrics), ``current()``, ``shutdown()``;
- ``spans``: W3C trace context in gRPC metadata, the drafter's and verifier's stream spans
  (``SessionTrace``), the per-request span bounds;
- ``request``: the gateway's ``Generate`` (``RequestTelemetry``): request span, rounds, metrics;
- ``metrics``: every metric, defined once in ``METRICS``; each is a Prometheus series on
  ``--metrics-port`` and, when configured, an OpenTelemetry instrument (``ServiceMetrics``,
  ``GenAIMetrics``).
"""

from specdec.telemetry.export import DETAILS, Telemetry, current, setup, shutdown
from specdec.telemetry.metrics import METRICS, GenAIMetrics, MetricDef, ServiceMetrics
from specdec.telemetry.request import RequestTelemetry
from specdec.telemetry.spans import MAX_ROUND_SPANS, MAX_SPANS_PER_REQUEST, SessionTrace

__all__ = [
    "DETAILS", "MAX_ROUND_SPANS", "MAX_SPANS_PER_REQUEST", "METRICS", "GenAIMetrics", "MetricDef",
    "RequestTelemetry", "ServiceMetrics", "SessionTrace", "Telemetry", "current", "setup", "shutdown",
]
