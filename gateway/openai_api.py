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
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from specdec.completion import Chunk
from specdec.rpc.server import error_field, error_message, status_for
from specdec.wire_types import FieldError, SamplingParams, is_utf8

from gateway.generation import Finished, GenerationRequest

CHAT = "chat"
COMPLETION = "completion"
# OpenAI's defaults where they differ from the gRPC API's (which is greedy unless told otherwise).
DEFAULT_TEMPERATURE = 1.0
SEED_RANGE = (-(2**63), 2**64)  # negative seeds wrap around to the unsigned 64-bit seed the services use
SPECULATION_FIELDS = ("method", "num_draft_tokens", "draft_ahead")

# Fields specdec does not implement, refused unless they hold the value that turns them off (so
# that a client never silently gets something other than what it asked for).
UNSUPPORTED: dict[str, tuple[Callable[[object], bool], str]] = {
    "n": (lambda v: v is None or (type(v) is int and v == 1), "one choice per request (n = 1)"),
    "best_of": (lambda v: v is None or (type(v) is int and v == 1), "best_of = 1 only"),
    "echo": (lambda v: v is None or v is False, "echo is not supported"),
    "suffix": (lambda v: v is None or v == "", "suffix is not supported"),
    "logprobs": (lambda v: v is None or v is False, "logprobs are not supported"),
    "top_logprobs": (lambda v: v is None or (type(v) is int and v == 0), "logprobs are not supported"),
    "presence_penalty": (lambda v: v is None or v == 0, "penalties are not supported (they would change the "
                                                         "target's distribution that speculation preserves)"),
    "frequency_penalty": (lambda v: v is None or v == 0, "penalties are not supported"),
    "logit_bias": (lambda v: v is None or v == {}, "logit_bias is not supported"),
    "tools": (lambda v: v is None or v == [], "tool calling is not supported"),
    "functions": (lambda v: v is None or v == [], "function calling is not supported"),
    "tool_choice": (lambda v: v is None or v == "none", "tool calling is not supported"),
    "function_call": (lambda v: v is None or v == "none", "function calling is not supported"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, "only text responses are supported"),
    "audio": (lambda v: v is None, "audio output is not supported"),
}

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


def _shown(value) -> str:
    """A client's value in an error message: short, and safe for any value (an array nested a
    thousand deep is not serialized again)."""
    if isinstance(value, (list, dict)):
        return "an array" if isinstance(value, list) else "an object"
    return json.dumps(value)[:40]


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
def _integer(value, param: str) -> int | None:
    if value is not None and type(value) is not int:  # bool is an int to Python, not to JSON
        raise invalid(param, f"must be an integer, not {_shown(value)}")
    return value


def _number(value, param: str) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float):
        raise invalid(param, f"must be a finite number, not {_shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer past any float
        number = math.inf
    if not math.isfinite(number):
        raise invalid(param, "must be a finite number")
    return number


def _boolean(value, param: str) -> bool | None:
    if value is not None and type(value) is not bool:
        raise invalid(param, "must be true or false")
    return value


def _text(value: str, param: str) -> str:
    """A string carried into the request: JSON's escapes can write a lone surrogate, which is not
    Unicode text (no tokenizer, nor protobuf, takes it)."""
    if not is_utf8(value):
        raise invalid(param, "not valid Unicode (a lone surrogate)")
    return value


def _strings(value, param: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid(param, "must be a string or an array of strings")
    return tuple(_text(s, param) for s in value)


def _token_ids(value, param: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise invalid(param, "must be an array of integer token ids")
    return value


def _content(value, where: str) -> str:
    """A message's content: a string, or text parts (joined by newlines, as vLLM does)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return _text(value, f"{where}.content")
    if not isinstance(value, list):
        raise invalid(f"{where}.content", "must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"{where}.content[{j}]", 'only text parts ({"type": "text", "text": ...}) are supported')
        texts.append(_text(part["text"], f"{where}.content[{j}].text"))
    return "\n".join(texts)


def _messages(body: dict) -> list[tuple[str, str]]:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise invalid("messages", "required: a non-empty array of messages")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str):
            raise invalid(f"{where}.role", "required: a string")
        _text(role, f"{where}.role")
        if message.get("tool_calls") or message.get("function_call"):
            raise invalid(f"{where}.tool_calls", "tool calling is not supported")
        # The role itself is checked by the request path (one list of roles for both APIs).
        messages.append((role, _content(message.get("content"), where)))  # developer: the request path maps it
    return messages


def _prompt(body: dict) -> dict:
    """``prompt`` (text) or ``prompt_token_ids`` for the request path: one prompt per request."""
    value = body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise invalid("prompt", "must not be empty")
        return {"prompt": _text(value, "prompt")}
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return {"prompt_token_ids": value}
    if isinstance(value, list) and len(value) > 1:
        raise invalid("prompt", "one prompt per request (arrays of several prompts are not supported)")
    raise invalid("prompt", "required: a string or an array of token ids")


def _speculation(body: dict) -> dict:
    value = body.get("speculation")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("speculation", "must be an object {method, num_draft_tokens, draft_ahead}")
    unknown = sorted(set(value) - set(SPECULATION_FIELDS))
    if unknown:
        raise invalid(f"speculation.{unknown[0]}", f"unknown field (known: {', '.join(SPECULATION_FIELDS)})")
    method = value.get("method")
    if method is not None and not isinstance(method, str):
        raise invalid("speculation.method", "must be a string")
    return {"method": _text(method or "", "speculation.method"),
            "num_draft_tokens": _integer(value.get("num_draft_tokens"), "speculation.num_draft_tokens") or 0,
            "draft_ahead": _boolean(value.get("draft_ahead"), "speculation.draft_ahead")}


def parse_request(body, kind: str, model_name: str, request_id: str) -> ApiRequest:
    """``body`` (decoded JSON) of a ``kind`` request; ``ApiError`` names the field it cannot take.

    ``model``: the served model's id (``GET /v1/models``), or absent; any other is 404."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", f"must be a string, not {_shown(model)}")
    if model is not None and model != model_name:
        raise ApiError(404, f"model {json.dumps(model)[:200]} is not served here; this gateway serves "
                            f"{json.dumps(model_name)} (GET /v1/models)", param="model", code="model_not_found")
    for name, (accepted, reason) in UNSUPPORTED.items():
        if name in body and not accepted(body[name]):
            raise invalid(name, reason)
    names = dict(FIELD_NAMES)
    inputs = {"messages": _messages(body)} if kind == CHAT else _prompt(body)
    names["input"] = "messages" if kind == CHAT else "prompt"
    max_tokens_name = "max_completion_tokens" if kind == CHAT and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    names["sampling.max_new_tokens"] = max_tokens_name
    max_tokens = _integer(body.get(max_tokens_name), max_tokens_name)
    if max_tokens is not None and max_tokens < 1:
        raise invalid(max_tokens_name, "must be >= 1")
    temperature = _number(body.get("temperature"), "temperature")
    top_p = _number(body.get("top_p"), "top_p")
    top_k = _integer(body.get("top_k"), "top_k")
    seed = _integer(body.get("seed"), "seed")
    if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise invalid("seed", "must fit in 64 bits")
    stop_token_ids = body.get("stop_token_ids")
    sampling = SamplingParams(
        max_new_tokens=max_tokens or 0,  # 0: the gateway's default
        temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None or top_k == -1 else top_k,  # -1: off, as in vLLM
        seed=None if seed is None else seed % 2**64,
        stop=_strings(body.get("stop"), "stop"),
        stop_token_ids=tuple(_token_ids(stop_token_ids, "stop_token_ids")) if stop_token_ids is not None else (),
        ignore_eos=bool(_boolean(body.get("ignore_eos"), "ignore_eos")),
    )
    stream = bool(_boolean(body.get("stream"), "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options", "must be an object")
    include_usage = bool(_boolean(options.get("include_usage"), "stream_options.include_usage")) \
        if stream and options else False
    generation = GenerationRequest(request_id=request_id, sampling=sampling, **inputs, **_speculation(body))
    return ApiRequest(kind, generation, stream=stream, include_usage=include_usage,
                      return_token_ids=bool(_boolean(body.get("return_token_ids"), "return_token_ids")), names=names)


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
