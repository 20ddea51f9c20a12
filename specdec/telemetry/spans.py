"""Spans: W3C trace context in gRPC metadata, the drafter's and verifier's stream spans, and the
helpers the gateway's request span (``request.py``) shares with them.

``tel`` below is the ``Telemetry`` that ``setup()`` installed (``export.py``); only its ``tracer``,
``detail`` and propagator are used. Nothing here imports OpenTelemetry until tracing is on.
"""

from __future__ import annotations

import time

MAX_ROUND_SPANS = 64  # round events / child spans per request and service; the rest are summed
# Upper bound on the spans of one request across the three services (request span + prefill +
# rounds on the gateway; stream span + steps on the drafter and on the verifier).
MAX_SPANS_PER_REQUEST = (2 + MAX_ROUND_SPANS) + 2 * (1 + MAX_ROUND_SPANS)


# -- W3C trace context in gRPC metadata -----------------------------------------------------------
def outgoing_metadata(tel, span) -> tuple[tuple[str, str], ...] | None:
    """``traceparent`` (and ``tracestate``/``baggage``) for a downstream call made under ``span``."""
    if span is None:
        return None
    from opentelemetry import trace

    carrier: dict[str, str] = {}
    tel._propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def incoming_context(tel, grpc_context):
    """The caller's trace context from a server call's invocation metadata."""
    carrier = {}
    for item in grpc_context.invocation_metadata() or ():
        key, value = item[0], item[1]
        if isinstance(value, str):
            carrier[key.lower()] = value
    return tel._propagate.extract(carrier)


# -- helpers ----------------------------------------------------------------------------------
def epoch_ns(perf_s: float) -> int:
    """A ``time.perf_counter()`` reading as epoch nanoseconds (span timestamps)."""
    return time.time_ns() - int((time.perf_counter() - perf_s) * 1e9)


def error_type(exc: BaseException) -> str:
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


def mark_failed(span, exc: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    kind = error_type(exc)
    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR, str(exc) or kind))


# -- drafter / verifier streams ---------------------------------------------------------------
def session_trace(tel, grpc_context, service: str, method: str, role: str) -> SessionTrace | None:
    """A drafter or verifier stream's span, a child of the caller's (``None`` when tracing is off)."""
    if tel.tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    span = tel.tracer.start_span(
        f"{service}/{method}",
        context=incoming_context(tel, grpc_context),
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, "specdec.role": role},
    )
    return SessionTrace(tel, span, role)


class SessionTrace:
    """A drafter or verifier stream: one span, and at detail ``round`` one child span per step
    (prefill / propose / verify), at most ``MAX_ROUND_SPANS``; counts summed onto the stream span."""

    def __init__(self, tel, span, role: str) -> None:
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
        mark_failed(self.span, exc)

    def end(self) -> None:
        for key, value in self.totals.items():
            self.span.set_attribute(f"specdec.{key}", value)
        self.span.set_attribute("specdec.trace.rounds_dropped", self.dropped)
        self.span.end()
