"""Tracing and metrics across the three services, exported over OTLP/gRPC to a real receiver.

The test process runs an OTLP collector (the TraceService and MetricsService of opentelemetry-proto)
on loopback; the gateway, a model drafter and a verifier run as subprocesses exporting to it. Each
request must come back as one trace holding spans of all three service.names, the gateway's request
span parenting the drafter's and verifier's stream spans, with the GenAI and specdec.* attributes
equal to what the client was told, and a bounded number of spans.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from specdec.client import ChunkEvent, GatewayClient
from specdec.telemetry import MAX_ROUND_SPANS, MAX_SPANS_PER_REQUEST
from tests.harness import metrics_text, start_stack
from tests.test_eagle_services import PROMPTS, head_prompts
from tests.tiny_models import build_eagle_head

GATEWAY, DRAFTER, VERIFIER = "specdec-gateway", "specdec-drafter", "specdec-verifier"


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    return getattr(any_value, kind) if kind else None


def _attrs(key_values) -> dict:
    return {kv.key: _value(kv.value) for kv in key_values}


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attrs: dict
    events: list  # (name, attrs)
    start_ns: int
    end_ns: int


class Receiver:
    """An OTLP/gRPC collector in the test process: keeps every span and metric name it receives."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[Span] = []
        self.metrics: dict[tuple[str, str], list] = defaultdict(list)  # (service, metric) -> data points
        receiver = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver._add_spans(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                receiver._add_metrics(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _add_spans(self, request) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            service = _attrs(resource_spans.resource.attributes).get("service.name")
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(Span(
                        service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), _attrs(s.attributes),
                        [(e.name, _attrs(e.attributes)) for e in s.events], s.start_time_unix_nano, s.end_time_unix_nano,
                    ))
        with self.lock:
            self.spans.extend(spans)

    def _add_metrics(self, request) -> None:
        with self.lock:
            for resource_metrics in request.resource_metrics:
                service = _attrs(resource_metrics.resource.attributes).get("service.name")
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        kind = metric.WhichOneof("data")
                        self.metrics[(service, metric.name)].extend(getattr(metric, kind).data_points)

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def request_span(self, request_id: str) -> Span | None:
        with self.lock:
            return next((s for s in self.spans if s.service == GATEWAY and s.attrs.get("specdec.request_id") == request_id), None)

    def wait_for_trace(self, request_id: str, services: set[str], timeout: float = 30.0) -> tuple[Span, list[Span]]:
        """The gateway's request span and the whole trace, once spans from ``services`` arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            root = self.request_span(request_id)
            if root is not None:
                spans = self.trace(root.trace_id)
                if services <= {s.service for s in spans}:
                    time.sleep(0.3)  # spans of one trace may come in more than one batch
                    return root, self.trace(root.trace_id)
            time.sleep(0.1)
        raise AssertionError(f"no complete trace for {request_id}; have {len(self.spans)} spans")

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture(scope="module")
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module", params=["request", "round"])
def traced(request, receiver, tiny_pair, tmp_path_factory):
    """(detail, stack): the three services exporting to ``receiver`` at one trace detail."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "SPECDEC_TRACE_DETAIL": request.param,
    }
    stack = start_stack(tiny_pair[1], tiny_pair[2], tmp_path_factory.mktemp(f"logs-{request.param}"),
                        metrics=True, env=env)
    # The gateway serves once a verifier is ready and learns of the drafter at its next refresh.
    deadline = time.monotonic() + 30
    while True:
        try:
            generate(stack.gateway.address, prompt="warm", max_new_tokens=2, method="model")
            break
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT or time.monotonic() > deadline:
                stack.stop()
                raise
            time.sleep(0.2)
    yield request.param, stack
    stack.stop()


def generate(address: str, **kwargs):
    """(token ids, final event) of one streamed generation."""
    tokens, final = [], None
    with GatewayClient(address, timeout=60) as client:
        for event in client.stream(**kwargs):
            if isinstance(event, ChunkEvent):
                tokens.extend(event.token_ids)
            else:
                final = event
    return tokens, final


def children(spans: list[Span], parent: Span, name: str | None = None) -> list[Span]:
    return [s for s in spans if s.parent_id == parent.span_id and (name is None or s.name == name)]


def one(spans: list[Span], service: str, name: str) -> Span:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


REQUESTS = [
    ("text_completion", dict(prompt="the quick brown fox", max_new_tokens=24, ignore_eos=True,
                             method="model", num_draft_tokens=3)),
    ("chat", dict(messages=[("user", "hello there")], max_new_tokens=20, ignore_eos=True, temperature=0.8,
                  top_p=0.9, top_k=20, seed=5, method="model", num_draft_tokens=0)),
]


@pytest.mark.parametrize("operation,kwargs", REQUESTS, ids=[r[0] for r in REQUESTS])
def test_one_trace_per_request_across_services(traced, receiver, tiny_pair, operation, kwargs):
    detail, stack = traced
    request_id = f"trace-{detail}-{operation}"
    tokens, final = generate(stack.gateway.address, request_id=request_id, **kwargs)
    stats = final.stats
    root, spans = receiver.wait_for_trace(request_id, {GATEWAY, DRAFTER, VERIFIER})

    # One trace id for the request, spanning all three services.
    assert {s.trace_id for s in spans} == {root.trace_id}
    assert {s.service for s in spans} == {GATEWAY, DRAFTER, VERIFIER}
    assert root.parent_id == ""  # the client sent no context: the gateway's span is the root
    # The gateway's request span parents the drafter's and the verifier's stream spans.
    verify = one(spans, VERIFIER, "specdec.v1.Verifier/Verify")
    draft = one(spans, DRAFTER, "specdec.v1.Drafter/Draft")
    assert verify.parent_id == root.span_id and draft.parent_id == root.span_id
    assert root.start_ns <= verify.start_ns and verify.end_ns <= root.end_ns

    # GenAI conventions.
    a = root.attrs
    model = str(tiny_pair[1])
    assert root.name == f"{operation} {model}"
    assert a["gen_ai.operation.name"] == operation
    assert a["gen_ai.request.model"] == model
    assert a["gen_ai.request.max_tokens"] == kwargs["max_new_tokens"]
    assert a["gen_ai.request.temperature"] == pytest.approx(kwargs.get("temperature", 0.0))
    assert a["gen_ai.request.top_p"] == pytest.approx(kwargs.get("top_p", 1.0))
    assert a["gen_ai.request.top_k"] == kwargs.get("top_k", 0)
    if "seed" in kwargs:
        assert a["gen_ai.request.seed"] == kwargs["seed"]
    else:
        assert isinstance(a["gen_ai.request.seed"], int)  # the gateway fixes one
    assert a["gen_ai.usage.input_tokens"] == final.prompt_tokens == len(final.prompt_token_ids)
    assert a["gen_ai.usage.output_tokens"] == final.completion_tokens == len(tokens)
    assert a["gen_ai.response.finish_reasons"] == (final.finish_reason,)
    assert a["gen_ai.response.id"] == request_id

    # Speculation figures, equal to the stats the client got.
    assert a["specdec.draft.method"] == stats["draft_method"] == "model"
    assert a["specdec.draft.model"] == str(tiny_pair[2])
    assert a["specdec.rounds"] == stats["rounds"]
    assert a["specdec.draft_tokens"] == stats["draft_tokens"]
    assert a["specdec.accepted_tokens"] == stats["accepted_tokens"]
    assert a["specdec.acceptance_rate"] == pytest.approx(stats["acceptance_rate"])
    assert a["specdec.mean_accepted_length"] == pytest.approx(stats["mean_accepted_length"])
    assert a["specdec.final_k"] == stats["k_history"][-1]
    assert a["specdec.trace.rounds_dropped"] == 0
    assert a["specdec.network_s"] >= 0 and a["specdec.verify_s"] > 0
    assert a["specdec.feature_bytes"] == stats["feature_bytes"] == 0  # a token-level drafter reads no features

    # The services' own counts agree.
    assert verify.attrs["specdec.verify.count"] == stats["rounds"]
    assert verify.attrs["specdec.verify.accepted"] == stats["accepted_tokens"]
    assert verify.attrs["specdec.prefill.prompt_tokens"] == final.prompt_tokens
    assert draft.attrs["specdec.propose.count"] == sum(1 for k in stats["k_history"] if k > 0)
    assert draft.attrs["specdec.propose.drafted"] == stats["draft_tokens"]
    assert draft.attrs["specdec.draft.model"] == str(tiny_pair[2])

    # Per-round data: events on the request span, or child spans.
    if detail == "request":
        rounds = [attrs for name, attrs in root.events if name == "specdec.round"]
        assert [n for n, _ in root.events].count("specdec.prefill") == 1
        assert len(spans) == 3
    else:
        rounds = [s.attrs for s in children(spans, root, "specdec.round")]
        assert len(children(spans, root, "specdec.prefill")) == 1
        assert len(children(spans, verify, "specdec.verifier.prefill")) == 1
        assert len(children(spans, verify, "specdec.verifier.verify")) == stats["rounds"]
        assert len(children(spans, draft, "specdec.drafter.propose")) == draft.attrs["specdec.propose.count"]
        assert len(children(spans, draft, "specdec.drafter.prefill")) == 1
    assert [r["specdec.round"] for r in rounds] == list(range(1, stats["rounds"] + 1))
    assert [r["specdec.drafted"] for r in rounds] == stats["k_history"]
    assert sum(r["specdec.accepted"] for r in rounds) == stats["accepted_tokens"]
    assert sum(r["specdec.emitted"] for r in rounds) + 1 == len(tokens)  # + the prefill's token
    assert all(r["specdec.network_s"] >= 0 and r["specdec.verify_s"] > 0 for r in rounds)
    assert len(spans) <= MAX_SPANS_PER_REQUEST


def test_feature_bytes_on_the_traces_of_an_eagle_request(receiver, tiny_pair, tiny_target, tmp_path):
    """Feature-level drafting: the bytes of target features per request, per round and per verifier
    step are on the spans, equal to the client's stats."""
    head = build_eagle_head(tmp_path / "head", tiny_pair[1], head_prompts(tiny_target.tokenizer))
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}", "OTEL_BSP_SCHEDULE_DELAY": "100",
           "SPECDEC_TRACE_DETAIL": "round"}
    stack = start_stack(tiny_pair[1], head, tmp_path, drafter_method="eagle", env=env)
    try:
        tokens, final = generate(stack.gateway.address, request_id="trace-eagle", prompt=PROMPTS[0],
                                 max_new_tokens=24, method="eagle", num_draft_tokens=3)
    finally:
        stack.stop()
    stats = final.stats
    root, spans = receiver.wait_for_trace("trace-eagle", {GATEWAY, DRAFTER, VERIFIER})
    assert stats["feature_bytes"] > 0 and root.attrs["specdec.feature_bytes"] == stats["feature_bytes"]
    assert root.attrs["specdec.feature_bytes_per_round"] == pytest.approx(stats["feature_bytes_per_round"])
    rounds = [s.attrs for s in children(spans, root, "specdec.round")]
    verify = one(spans, VERIFIER, "specdec.v1.Verifier/Verify")
    row = tiny_target.model.config.hidden_size * 2
    assert verify.attrs["specdec.prefill.feature_bytes"] == final.prompt_tokens * row
    assert sum(r.get("specdec.feature_bytes", 0) for r in rounds) == verify.attrs["specdec.verify.feature_bytes"]
    assert verify.attrs["specdec.prefill.feature_bytes"] + verify.attrs["specdec.verify.feature_bytes"] == stats["feature_bytes"]


def test_span_count_per_request_is_bounded(traced, receiver):
    detail, stack = traced
    request_id = f"trace-{detail}-long"
    tokens, final = generate(stack.gateway.address, request_id=request_id, prompt="numbers 0 1 2",
                             max_new_tokens=160, ignore_eos=True, method="model", num_draft_tokens=1)
    rounds = final.stats["rounds"]
    assert rounds > MAX_ROUND_SPANS + 10
    root, spans = receiver.wait_for_trace(request_id, {GATEWAY, DRAFTER, VERIFIER})
    verify = one(spans, VERIFIER, "specdec.v1.Verifier/Verify")
    draft = one(spans, DRAFTER, "specdec.v1.Drafter/Draft")
    assert len(spans) <= MAX_SPANS_PER_REQUEST
    # Every round is still counted, only the first MAX_ROUND_SPANS are itemised.
    assert root.attrs["specdec.rounds"] == rounds and verify.attrs["specdec.verify.count"] == rounds
    assert root.attrs["specdec.trace.rounds_dropped"] == rounds - MAX_ROUND_SPANS
    if detail == "request":
        assert len(spans) == 3
        assert sum(1 for name, _ in root.events if name == "specdec.round") == MAX_ROUND_SPANS
    else:
        assert len(children(spans, root, "specdec.round")) == MAX_ROUND_SPANS
        assert len(children(spans, verify)) == MAX_ROUND_SPANS  # prefill + 63 verifies
        assert verify.attrs["specdec.trace.rounds_dropped"] == rounds + 1 - MAX_ROUND_SPANS
        assert len(children(spans, draft)) == MAX_ROUND_SPANS


def test_genai_metrics_over_otlp_and_prometheus(traced, receiver):
    detail, stack = traced
    generate(stack.gateway.address, request_id=f"metrics-{detail}", prompt="def add(a, b):",
             max_new_tokens=12, ignore_eos=True, method="model", num_draft_tokens=2)
    wanted = {(GATEWAY, "gen_ai.server.time_to_first_token"), (GATEWAY, "gen_ai.server.time_per_output_token"),
              (GATEWAY, "gen_ai.server.request.duration"), (GATEWAY, "specdec.acceptance_rate"),
              (GATEWAY, "specdec.accepted_length"), (GATEWAY, "specdec.draft_length"),
              (GATEWAY, "specdec.position.accepted"), (GATEWAY, "specdec.active_sessions"),
              (DRAFTER, "specdec.active_sessions"), (VERIFIER, "specdec.active_sessions")}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not wanted <= set(receiver.metrics):
        time.sleep(0.2)
    assert wanted <= set(receiver.metrics), wanted - set(receiver.metrics)
    text = metrics_text(stack.gateway)
    for series in ("gen_ai_server_time_to_first_token_seconds_count", "gen_ai_server_time_per_output_token_seconds_count",
                   "gen_ai_server_request_duration_seconds_count", "specdec_acceptance_rate_count",
                   "specdec_accepted_length_count", "specdec_draft_length_count",
                   'specdec_position_accepted_total{specdec_draft_method="model",specdec_position="0"}',
                   'specdec_active_sessions{role="gateway"}'):
        assert series in text, series


def test_no_endpoint_installs_nothing(monkeypatch):
    from specdec import telemetry

    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    try:
        tel = telemetry.setup("specdec-test")
        assert tel.tracer is None and tel.meter is None and not tel._providers
        assert tel.outgoing_metadata(None) is None
        assert tel.session_trace(None, "svc", "Method", "role") is None
    finally:
        telemetry.setup("specdec-test")  # leave the disabled default behind
