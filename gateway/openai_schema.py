"""The bodies of ``/v1/completions`` and ``/v1/chat/completions`` as pydantic models (the library
vLLM's and SGLang's OpenAI servers validate them with): strict JSON types, and a ``FieldError`` naming
the first field that fails, in the request's own names (``messages[2].content[0].text``,
``speculation.method``), with the message the gateway gives (``ERROR_MESSAGES``).

Shapes that are one of several (a prompt as text or token ids, ``stop`` as a string or an array, a
message's content as text or text parts) are read by their own validators, which report what was
wrong in the request's terms rather than one error per shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, \
    StrictStr, ValidationError, create_model
from pydantic_core import PydanticCustomError

from specdec.wire_types import FieldError, is_utf8

SPECULATION_FIELDS = ("method", "num_draft_tokens", "draft_ahead", "cache_scope", "auto_methods")

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
# A custom error's context may carry a path below its field (``[1].text`` under a message's content).
SUBPATH = "subpath"


def shown(value) -> str:
    """A client's value in an error message: short, and safe for any value (an array nested a
    thousand deep is not serialized again)."""
    if isinstance(value, (list, dict)):
        return "an array" if isinstance(value, list) else "an object"
    return json.dumps(value)[:40]


def _refuse(message: str, subpath: str = "") -> PydanticCustomError:
    return PydanticCustomError("specdec", message, {SUBPATH: subpath} if subpath else None)


def _unicode(value: str) -> str:
    """JSON's escapes can write a lone surrogate, which is not Unicode text (no tokenizer, nor protobuf, takes it)."""
    if not is_utf8(value):
        raise _refuse("not valid Unicode (a lone surrogate)")
    return value


Text = Annotated[StrictStr, AfterValidator(_unicode)]
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
MaxTokens = Annotated[StrictInt, Field(ge=1)]
# Negative seeds wrap around to the unsigned 64-bit seed the services use.
Seed = Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)]


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise _refuse("must be a string or an array of strings")
    return tuple(_unicode(s) for s in strings)


def _token_ids(value) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise _refuse("must be an array of integer token ids")
    return tuple(value)


def _content(value) -> str:
    """A message's content: a string, or text parts (joined by newlines, as vLLM does)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return _unicode(value)
    if not isinstance(value, list):
        raise _refuse("must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _refuse('only text parts ({"type": "text", "text": ...}) are supported', f"[{j}]")
        if not is_utf8(part["text"]):
            raise _refuse("not valid Unicode (a lone surrogate)", f"[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def _prompt(value) -> dict:
    """``prompt`` (text) or ``prompt_token_ids`` for the request path: one prompt per request."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise _refuse("must not be empty")
        return {"prompt": _unicode(value)}
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return {"prompt_token_ids": value}
    if isinstance(value, list) and len(value) > 1:
        raise _refuse("one prompt per request (arrays of several prompts are not supported)")
    raise _refuse("required: a string or an array of token ids")


class Speculation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: Text | None = None
    num_draft_tokens: StrictInt | None = None
    draft_ahead: StrictBool | None = None
    cache_scope: Text | None = None
    auto_methods: tuple[Text, ...] | None = None


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = None


def _no_tools(value):
    if value:
        raise _refuse("tool calling is not supported")
    return value


class Message(BaseModel):
    role: Text  # which roles: the request path's to say (one list for both APIs)
    tool_calls: Annotated[Any, AfterValidator(_no_tools)] = None
    function_call: Annotated[Any, AfterValidator(_no_tools)] = None
    content: Annotated[str, BeforeValidator(_content)] = ""


def _unsupported(name: str, accepted: Callable[[object], bool], reason: str):
    def refuse_unless_off(value):
        if not accepted(value):
            raise _refuse(reason)
        return value

    return Annotated[Any, AfterValidator(refuse_unless_off)], None


# What both routes begin with, in the order they are checked (the first that fails is reported): the
# model, then every field of UNSUPPORTED. Fields named nowhere are ignored (OpenAI's SDKs may send more).
_Body = create_model("_Body", __config__=ConfigDict(extra="allow"), model=(StrictStr | None, None),
                     **{name: _unsupported(name, *rule) for name, rule in UNSUPPORTED.items()})


# What both routes take after their input (in that order too).
SAMPLING_FIELDS = {
    "max_tokens": (MaxTokens | None, None),
    "temperature": (Number | None, None),
    "top_p": (Number | None, None),
    "top_k": (StrictInt | None, None),
    "seed": (Seed | None, None),
    "stop": (Annotated[tuple[str, ...], BeforeValidator(_stop)], ()),
    "stop_token_ids": (Annotated[tuple[int, ...] | None, BeforeValidator(_token_ids)], None),
    "ignore_eos": (StrictBool | None, None),
    "stream": (StrictBool | None, None),
    "stream_options": (StreamOptions | None, None),
    "speculation": (Speculation | None, None),
    "return_token_ids": (StrictBool | None, None),
}
ChatBody = create_model("ChatBody", __base__=_Body, messages=(Annotated[list[Message], Field(min_length=1)], ...),
                        max_completion_tokens=(MaxTokens | None, None), **SAMPLING_FIELDS)
CompletionBody = create_model("CompletionBody", __base__=_Body, prompt=(Annotated[dict, BeforeValidator(_prompt)], ...),
                              **SAMPLING_FIELDS)


# pydantic's error types -> the gateway's message ({shown}: the value as the client sent it). Keyed by
# (field name, type) where one field says it its own way, else by type.
ERROR_MESSAGES = {
    "int_type": "must be an integer, not {shown}",
    "bool_type": "must be true or false",
    "string_type": "must be a string, not {shown}",
    "float_type": "must be a finite number, not {shown}",
    "finite_number": "must be a finite number",
    "model_type": "must be an object",
    "extra_forbidden": "unknown field (known: " + ", ".join(SPECULATION_FIELDS) + ")",
    ("messages", "missing"): "required: a non-empty array of messages",
    ("messages", "list_type"): "required: a non-empty array of messages",
    ("messages", "too_short"): "required: a non-empty array of messages",
    ("messages[]", "model_type"): "must be an object with role and content",
    ("role", "missing"): "required: a string",
    ("role", "string_type"): "required: a string",
    ("prompt", "missing"): "required: a string or an array of token ids",
    ("speculation", "model_type"): "must be an object {" + ", ".join(SPECULATION_FIELDS) + "}",
    ("max_tokens", "greater_than_equal"): "must be >= 1",
    ("max_completion_tokens", "greater_than_equal"): "must be >= 1",
    ("seed", "greater_than_equal"): "must fit in 64 bits",
    ("seed", "less_than"): "must fit in 64 bits",
}


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def field_error(error: ValidationError) -> FieldError:
    """The first error of ``error`` as the gateway reports it."""
    first = error.errors(include_url=False)[0]
    loc, kind, value = tuple(first["loc"]), first["type"], first.get("input")
    field = _path(loc) + (first.get("ctx") or {}).get(SUBPATH, "")
    if kind == "specdec":
        return FieldError(field, first["msg"])
    if kind == "float_type" and type(value) is int:  # an integer past any float
        kind = "finite_number"
    name = "messages[]" if len(loc) == 2 and loc[0] == "messages" else str(loc[-1])
    template = ERROR_MESSAGES.get((name, kind)) or ERROR_MESSAGES.get(kind) or first["msg"]
    return FieldError(field, template.format(shown=shown(value)) if "{shown}" in template else template)


def validate_body(body: dict, chat: bool) -> BaseModel:
    """``body`` (decoded JSON, an object) as the route's model; ``FieldError`` for the first field
    it cannot take."""
    try:
        return (ChatBody if chat else CompletionBody).model_validate(body)
    except ValidationError as exc:
        raise field_error(exc) from None
