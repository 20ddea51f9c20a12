"""The OpenAI API's JSON at the gateway's edge: bodies of ``/v1/completions`` and
``/v1/chat/completions`` into a ``GenerationRequest``, the request path's events into response
objects and server-sent-event chunks, and the gateway's errors into OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``). Pure translation: no I/O (``gateway/http.py``
serves it).

Extensions beside OpenAI's fields (clients that do not know them never send them): ``speculation``
{``method``, ``num_draft_tokens``, ``draft_ahead``} as in the gRPC API; vLLM's ``top_k``,
``ignore_eos``, ``stop_token_ids`` and ``return_token_ids``. Responses add ``speculation_stats``
(the gRPC API's ``stats``) and, with ``return_token_ids``, ``prompt_token_ids`` and each choice's
``token_ids``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

import grpc

from specdec.completion import Chunk
from specdec.rpc.server import error_field, error_message, status_for
from specdec.wire_types import FieldError, SamplingParams

from gateway.generation import Finished, GenerationRequest
from gateway.openai_schema import validate_body

CHAT = "chat"
COMPLETION = "completion"
# OpenAI's defaults where they differ from the gRPC API's (which is greedy unless told otherwise).
DEFAULT_TEMPERATURE = 1.0

# The gateway's field names (gRPC API) -> the OpenAI request's, where they differ.
FIELD_NAMES = {
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.seed": "seed",
    "sampling.stop": "stop",
    "sampling.stop_token_ids": "stop_token_ids",
    "prompt_token_ids": "prompt",
}

# A gRPC status of the request path -> (HTTP status, OpenAI error type, error code).
HTTP_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
INTERNAL_ERROR = (500, "server_error", None)


class ApiError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class DeadlineExceeded(ApiError):
    """The request's deadline passed: 504, as DEADLINE_EXCEEDED on the request path."""

    def __init__(self, message: str) -> None:
        status, kind, code = HTTP_ERRORS[grpc.StatusCode.DEADLINE_EXCEEDED]
        super().__init__(status, message, kind, code=code)


def invalid(param: str, reason: str) -> ApiError:
    """400 naming ``param``."""
    return ApiError(400, f"{param}: {reason}", param=param)


@dataclass
class ApiRequest:
    """A parsed request: what goes to the request path, and how to answer."""

    kind: str  # CHAT or COMPLETION
    generation: GenerationRequest
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    # The gateway's field names -> the names this request used (``max_tokens`` or ``max_completion_tokens``).
    names: dict[str, str] = field(default_factory=dict)


def response_id(kind: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex


# -- requests ------------------------------------------------------------------------------------
def parse_request(body, kind: str, model_name: str, request_id: str) -> ApiRequest:
    """``body`` (decoded JSON) of a ``kind`` request; ``ApiError`` names the field it cannot take
    (``openai_schema`` validates the body).

    ``model``: the served model's id (``GET /v1/models``), or absent; any other is 404."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if isinstance(model, str) and model != model_name:
        raise ApiError(404, f"model {json.dumps(model)[:200]} is not served here; this gateway serves "
                            f"{json.dumps(model_name)} (GET /v1/models)", param="model", code="model_not_found")
    try:
        parsed = validate_body(body, chat=kind == CHAT)
    except FieldError as exc:
        raise invalid(exc.field, exc.reason) from None
    names = dict(FIELD_NAMES)
    if kind == CHAT:
        inputs = {"messages": [(m.role, m.content) for m in parsed.messages]}  # developer: the request path maps it
        names["input"] = "messages"
    else:
        inputs, names["input"] = parsed.prompt, "prompt"
    use_completion_tokens = kind == CHAT and parsed.max_completion_tokens is not None
    names["sampling.max_new_tokens"] = "max_completion_tokens" if use_completion_tokens else "max_tokens"
    max_tokens = parsed.max_completion_tokens if use_completion_tokens else parsed.max_tokens
    sampling = SamplingParams(
        max_new_tokens=max_tokens or 0,  # 0: the gateway's default
        temperature=DEFAULT_TEMPERATURE if parsed.temperature is None else parsed.temperature,
        top_p=1.0 if parsed.top_p is None else parsed.top_p,
        top_k=0 if parsed.top_k is None or parsed.top_k == -1 else parsed.top_k,  # -1: off, as in vLLM
        seed=None if parsed.seed is None else parsed.seed % 2**64,
        stop=parsed.stop,
        stop_token_ids=parsed.stop_token_ids or (),
        ignore_eos=bool(parsed.ignore_eos),
    )
    stream = bool(parsed.stream)
    options = parsed.stream_options
    include_usage = bool(options.include_usage) if stream and options is not None else False
    speculation = parsed.speculation
    speculation_fields = {} if speculation is None else {
        "method": speculation.method or "", "num_draft_tokens": speculation.num_draft_tokens or 0,
        "draft_ahead": speculation.draft_ahead, "cache_scope": speculation.cache_scope or "",
        "auto_methods": speculation.auto_methods or ()}
    generation = GenerationRequest(request_id=request_id, sampling=sampling, **inputs, **speculation_fields)
    return ApiRequest(kind, generation, stream=stream, include_usage=include_usage,
                      return_token_ids=bool(parsed.return_token_ids), names=names)


# -- errors --------------------------------------------------------------------------------------
def error_for(exc: BaseException, names: dict[str, str]) -> ApiError:
    """The request path's exception as an OpenAI error; the field it names (a ``FieldError``'s, or
    the one a downstream status carries) is ``param``, renamed to this API's (``sampling.max_new_tokens``
    -> ``max_tokens``)."""
    if isinstance(exc, ApiError):
        return exc
    code = status_for(exc)
    status, kind, error_code = HTTP_ERRORS.get(code, INTERNAL_ERROR)
    message = error_message(exc) if code != grpc.StatusCode.INTERNAL else "internal error in the gateway"
    field = error_field(exc) if status == 400 else None
    param = names.get(field, field)
    if isinstance(exc, FieldError) and param is not None:
        message = f"{param}: {exc.reason}"
    return ApiError(status, message, kind, param, error_code)


# -- responses -----------------------------------------------------------------------------------
def usage(finished: Finished) -> dict:
    result = finished.result
    completion_tokens = len(result.token_ids)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": result.prompt_tokens + completion_tokens}


class ResponseWriter:
    """The response objects of one request, streamed or whole, in OpenAI's shapes."""

    def __init__(self, request: ApiRequest, model: str) -> None:
        self.request = request
        self.id = request.generation.request_id
        self.model = model
        self.created = int(time.time())
        self.chat = request.kind == CHAT
        self.object = "chat.completion" if self.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        self.role_sent = False

    def _choice(self, text: str | None, token_ids: list[int] | None, finish_reason: str | None,
                streamed: bool) -> dict:
        if self.chat and streamed:
            delta = {} if text is None else {"content": text}
            if not self.role_sent:
                delta = {"role": "assistant", **delta}
                self.role_sent = True
            choice = {"index": 0, "delta": delta}
        elif self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish_reason)
        if self.request.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    def _object(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, event: Chunk) -> dict:
        """A streamed chunk of committed tokens."""
        out = self._object(self.chunk_object, [self._choice(event.text, list(event.token_ids), None, True)])
        if self.request.include_usage:
            out["usage"] = None  # as OpenAI: every chunk has it, only the last is filled
        return out

    def final_chunks(self, finished: Finished) -> list[dict]:
        """The chunk with the finish reason (and the speculative stats), then the usage chunk if asked for."""
        last = self._object(self.chunk_object, [self._choice(None, None, finished.result.finish_reason, True)])
        self._extensions(last, finished)
        chunks = [last]
        if self.request.include_usage:
            last["usage"] = None
            chunks.append({**self._object(self.chunk_object, []), "usage": usage(finished)})
        return chunks

    def whole(self, text: str, token_ids: list[int], finished: Finished) -> dict:
        """The non-streamed response."""
        out = self._object(self.object, [self._choice(text, token_ids, finished.result.finish_reason, False)])
        out["usage"] = usage(finished)
        self._extensions(out, finished)
        return out

    def _extensions(self, out: dict, finished: Finished) -> None:
        out["speculation_stats"] = finished.result.stats.to_dict()
        if self.request.return_token_ids:
            out["prompt_token_ids"] = finished.prompt_token_ids


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [model_object(model, created)]}


def model_object(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "specdec"}
