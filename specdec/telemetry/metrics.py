"""Every metric the services export, defined once in ``METRICS`` and recorded with one call.

A row of ``METRICS`` (``MetricDef``) gives a metric's OpenTelemetry name, kind, unit, description,
attributes and histogram buckets. From it come both

- the Prometheus series on the service's ``--metrics-port`` (``prometheus_client``): the name with
  ``.`` turned into ``_`` and ``_seconds`` appended for unit ``s`` (counters get ``_total`` from the
  client), the attributes as labels the same way (``gen_ai.request.model`` -> ``gen_ai_request_model``);
- and, when ``setup()`` installed a meter, the OpenTelemetry instrument exported over OTLP, whose
  histograms get the same bucket boundaries through the views of ``metric_views()``.

``Instrument.labels(*values)`` binds label values in the definition's order; the bound metric's
``inc`` / ``observe`` / ``set`` records to both. An empty label value is a Prometheus label ``""`` and
no OTel attribute at all (``error.type`` is only set on failures, as the conventions ask).
"""

from __future__ import annotations

from dataclasses import dataclass

import prometheus_client

# Bucket boundaries advised by the GenAI semantic conventions.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
# specdec's own.
RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BATCH_PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

COUNTER, HISTOGRAM, UPDOWN = "counter", "histogram", "updown"  # UPDOWN: a Prometheus gauge


@dataclass(frozen=True)
class MetricDef:
    name: str  # OpenTelemetry instrument name
    kind: str  # COUNTER, HISTOGRAM or UPDOWN (set to a value; OTel: an observable up-down counter)
    unit: str  # UCUM, as OpenTelemetry wants it; "s" also names the Prometheus series ..._seconds
    description: str  # also the Prometheus HELP text
    attributes: tuple[str, ...]  # OTel attribute names = Prometheus labels with "." -> "_"
    buckets: tuple[float, ...] = ()  # histograms: bucket upper bounds (Prometheus adds +Inf)

    @property
    def prometheus_name(self) -> str:
        name = self.name.replace(".", "_")
        return f"{name}_seconds" if self.unit == "s" else name

    @property
    def prometheus_labels(self) -> tuple[str, ...]:
        return tuple(a.replace(".", "_") for a in self.attributes)


ROLE = ("role",)
GENAI = ("gen_ai.operation.name", "gen_ai.request.model")
METHOD = ("specdec.draft.method",)

METRICS: dict[str, MetricDef] = {d.name: d for d in (
    # Every service, labelled with its role (gateway, drafter, verifier).
    MetricDef("specdec.active_sessions", UPDOWN, "{session}",
              "Generation sessions holding state on this service", ROLE),
    MetricDef("specdec.requests", COUNTER, "{session}", "Sessions (or gateway requests) started", ROLE),
    MetricDef("specdec.rejected_requests", COUNTER, "{request}", "Requests refused (bad input or overload)",
              ROLE + ("code",)),
    MetricDef("specdec.tokens", COUNTER, "{token}",
              "Tokens produced: committed on verifier/gateway, drafted on drafter", ROLE),
    MetricDef("specdec.draft_tokens", COUNTER, "{token}", "Draft tokens verified", ROLE),
    MetricDef("specdec.accepted_tokens", COUNTER, "{token}", "Draft tokens accepted", ROLE),
    MetricDef("specdec.batch_size", HISTOGRAM, "{session}", "Sessions served by one batched forward pass", ROLE,
              BATCH_SIZE_BUCKETS),
    MetricDef("specdec.batch_pass", HISTOGRAM, "s", "Duration of one batched forward pass", ROLE,
              BATCH_PASS_BUCKETS),
    MetricDef("specdec.prefill_chunks", COUNTER, "{chunk}",
              "Prompt chunks fed in passes shared with decoding sessions (chunked prefill)", ROLE),
    MetricDef("specdec.batch_queue_wait", HISTOGRAM, "s", "A message's wait for the batched pass that served it",
              ROLE, QUEUE_WAIT_BUCKETS),
    # The gateway's requests and rounds (GenAI semantic conventions, then speculation).
    MetricDef("gen_ai.server.time_to_first_token", HISTOGRAM, "s", "Time to first token (gateway)", GENAI,
              TTFT_BUCKETS),
    MetricDef("gen_ai.server.time_per_output_token", HISTOGRAM, "s", "Time per output token after the first",
              GENAI, TPOT_BUCKETS),
    MetricDef("gen_ai.server.request.duration", HISTOGRAM, "s", "Generate duration", GENAI + ("error.type",),
              DURATION_BUCKETS),
    MetricDef("specdec.acceptance_rate", HISTOGRAM, "1", "Accepted / drafted tokens per request", METHOD,
              RATE_BUCKETS),
    MetricDef("specdec.accepted_length", HISTOGRAM, "{token}", "Tokens committed per verification round", METHOD,
              LENGTH_BUCKETS),
    MetricDef("specdec.draft_length", HISTOGRAM, "{token}", "Draft length k chosen per round", METHOD,
              LENGTH_BUCKETS),
    MetricDef("specdec.position.drafted", COUNTER, "{token}", "Drafts verified at each position of a block",
              METHOD + ("specdec.position",)),
    MetricDef("specdec.position.accepted", COUNTER, "{token}", "Drafts accepted at each position of a block",
              METHOD + ("specdec.position",)),
)}


def metric_views() -> list:
    """OTel SDK views giving each histogram of ``METRICS`` its bucket boundaries (``setup()``)."""
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

    return [View(instrument_name=d.name, aggregation=ExplicitBucketHistogramAggregation(d.buckets))
            for d in METRICS.values() if d.kind == HISTOGRAM]


class Instrument:
    """One metric of ``METRICS``: its Prometheus series in ``registry`` and, with a ``meter``, its
    OpenTelemetry instrument."""

    def __init__(self, definition: MetricDef, registry, meter=None) -> None:
        d = self.definition = definition
        labels = d.prometheus_labels
        if d.kind == COUNTER:
            self.prometheus = prometheus_client.Counter(d.prometheus_name, d.description, labels, registry=registry)
        elif d.kind == HISTOGRAM:
            self.prometheus = prometheus_client.Histogram(d.prometheus_name, d.description, labels,
                                                          registry=registry, buckets=d.buckets)
        elif d.kind == UPDOWN:
            self.prometheus = prometheus_client.Gauge(d.prometheus_name, d.description, labels, registry=registry)
        else:
            raise ValueError(f"{d.name}: unknown metric kind {d.kind!r}")
        self.otel = None
        self.values: dict[tuple, tuple[dict, float]] = {}  # UPDOWN: label values -> (attributes, last value set)
        if meter is not None:
            if d.kind == COUNTER:
                self.otel = meter.create_counter(d.name, d.unit, d.description)
            elif d.kind == HISTOGRAM:
                self.otel = meter.create_histogram(d.name, d.unit, d.description)
            else:
                meter.create_observable_up_down_counter(d.name, callbacks=[self._observe], unit=d.unit,
                                                        description=d.description)
        self._bound: dict[tuple, BoundMetric] = {}

    def labels(self, *values) -> BoundMetric:
        """The metric for these label values (in the definition's order)."""
        bound = self._bound.get(values)
        if bound is None:
            attributes = {a: v for a, v in zip(self.definition.attributes, values, strict=True) if v != ""}
            bound = self._bound[values] = BoundMetric(self, values, attributes)
        return bound

    def _observe(self, _options):
        from opentelemetry.metrics import Observation

        return [Observation(value, attributes) for attributes, value in list(self.values.values())]


class BoundMetric:
    """A metric with its label values bound: each call records to Prometheus and, if on, OpenTelemetry."""

    __slots__ = ("_instrument", "_values", "_prometheus", "_otel", "attributes")

    def __init__(self, instrument: Instrument, values: tuple, attributes: dict) -> None:
        self._instrument = instrument
        self._values = values
        self._prometheus = instrument.prometheus.labels(*values)
        self._otel = instrument.otel
        self.attributes = attributes
        if instrument.definition.kind == UPDOWN:
            instrument.values[values] = (attributes, 0)  # exported as 0 until set, as the Prometheus gauge is

    def inc(self, amount: float = 1) -> None:
        self._prometheus.inc(amount)
        if self._otel is not None:
            self._otel.add(amount, self.attributes)

    def observe(self, value: float) -> None:
        self._prometheus.observe(value)
        if self._otel is not None:
            self._otel.record(value, self.attributes)

    def set(self, value: float) -> None:
        self._prometheus.set(value)
        self._instrument.values[self._values] = (self.attributes, value)


def instrument(name: str, registry, tel=None) -> Instrument:
    """The metric ``name`` of ``METRICS`` on ``registry``, and on ``tel``'s meter when one is installed."""
    return Instrument(METRICS[name], registry, getattr(tel, "meter", None))


class ServiceMetrics:
    """What every service exports, labelled with its ``role`` (``rejected`` also takes a status code)."""

    def __init__(self, registry, role: str, tel=None) -> None:
        def bound(name: str) -> BoundMetric:
            return instrument(name, registry, tel).labels(role)

        self.active_sessions = bound("specdec.active_sessions")
        self.requests = bound("specdec.requests")
        self.rejected = instrument("specdec.rejected_requests", registry, tel)  # .labels(role, code)
        self.tokens = bound("specdec.tokens")
        self.draft_tokens = bound("specdec.draft_tokens")
        self.accepted_tokens = bound("specdec.accepted_tokens")
        self.batch_size = bound("specdec.batch_size")
        self.batch_pass_seconds = bound("specdec.batch_pass")
        self.prefill_chunks = bound("specdec.prefill_chunks")
        self.batch_queue_wait_seconds = bound("specdec.batch_queue_wait")


class GenAIMetrics:
    """The gateway's request and round metrics."""

    def __init__(self, registry, tel=None) -> None:
        def make(name: str) -> Instrument:
            return instrument(name, registry, tel)

        self.ttft = make("gen_ai.server.time_to_first_token")
        self.tpot = make("gen_ai.server.time_per_output_token")
        self.duration = make("gen_ai.server.request.duration")
        self.rate = make("specdec.acceptance_rate")
        self.length = make("specdec.accepted_length")
        self.k = make("specdec.draft_length")
        self.pos_drafted = make("specdec.position.drafted")
        self.pos_accepted = make("specdec.position.accepted")

    def round(self, method: str, k: int, emitted: int) -> None:
        self.length.labels(method).observe(emitted)
        self.k.labels(method).observe(k)

    def request(self, operation: str, model: str, method: str, duration_s: float, error_type: str = "",
                ttft_s: float | None = None, tpot_s: float | None = None, stats=None) -> None:
        self.duration.labels(operation, model, error_type).observe(duration_s)
        if ttft_s is not None:
            self.ttft.labels(operation, model).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.labels(operation, model).observe(tpot_s)
        if stats is None or not stats.draft_tokens:
            return
        self.rate.labels(method).observe(stats.acceptance_rate)
        for position, (drafted, accepted) in enumerate(zip(stats.per_position_drafted, stats.per_position_accepted)):
            self.pos_drafted.labels(method, position).inc(drafted)
            self.pos_accepted.labels(method, position).inc(accepted)
