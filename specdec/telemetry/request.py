"""The gateway's side of one ``Generate``: its request span with the rounds as events or child
spans, the W3C context for the downstream streams, and the request's metrics (``GenAIMetrics``)."""

from __future__ import annotations

import time

from specdec.telemetry.metrics import GenAIMetrics
from specdec.telemetry.spans import MAX_ROUND_SPANS, epoch_ns, error_type, mark_failed, outgoing_metadata


class RequestTelemetry:
    """One gateway ``Generate``: its span (when tracing), round events or spans, and its metrics.

    Lifecycle: ``begin()`` once the request is validated, ``metadata()`` for the downstream streams,
    ``on_round`` as the loop's observer, ``finish(result)`` with the final result, then ``end()``
    (``fail(exc)`` first on an error or cancel). ``attributes``: the front's own (``rpc.*`` for
    gRPC, ``http.*`` for the HTTP API), on the span from its start.
    """

    def __init__(self, tel, metrics: GenAIMetrics, operation: str, model: str, attributes: dict | None = None) -> None:
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
                            "gen_ai.request.model": model, "specdec.trace.detail": tel.detail,
                            **(attributes or {})},
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

    def set_attributes(self, attributes: dict) -> None:
        """Attributes known only later (the HTTP status of the response)."""
        if self.span is not None:
            self.span.set_attributes(attributes)

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
        return outgoing_metadata(self.tel, self._context_span)

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
        if record.feature_bytes:
            attrs["specdec.feature_bytes"] = record.feature_bytes
        self._step("specdec.round", record.started, record.draft_s + record.verify_s, attrs)

    def _step(self, name: str, started: float, elapsed: float, attrs: dict) -> None:
        start_ns = epoch_ns(started)
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
            "specdec.feature_bytes": stats.feature_bytes,
            "specdec.feature_bytes_per_round": stats.feature_bytes_per_round,
        })

    def fail(self, exc: BaseException) -> None:
        self.error_type = error_type(exc)
        if self.span is not None:
            mark_failed(self.span, exc)

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
