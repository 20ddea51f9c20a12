"""Hypothesis strategies for bodies of the OpenAI API's POST routes: arbitrary JSON (lone
surrogates in strings, integers past int64 and float64, NaN and infinities), the request's fields
with plausible and arbitrary values, and JSON nested deeper than a parser goes."""

from __future__ import annotations

import json

from hypothesis import strategies as st

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def nested(depth: int, opener: bytes) -> bytes:
    """A JSON value ``depth`` arrays or objects deep (written by hand: no encoder goes that deep)."""
    return opener * depth + b"0" + (b"]" if opener == b"[" else b"}") * depth


TEXT = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=12)
# Past int64, float64 (as integers) and any float: NaN and Infinity too, which Python's JSON writes.
NUMBERS = st.one_of(st.integers(-3, 300), st.integers(), st.integers(-(10**400), 10**400),
                    st.sampled_from([2**32, 2**64, -(2**63) - 1, 10**309, -(10**4000)]), st.floats(),
                    st.sampled_from([1e308, -1e308, 5e-324]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
ANY_JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)
ROLES = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), ANY_JSON)
PARTS = st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(TEXT, ANY_JSON)}),
                           ANY_JSON), max_size=3)
MESSAGE = st.one_of(st.fixed_dictionaries({"role": ROLES, "content": st.one_of(TEXT, PARTS, ANY_JSON)},
                                          optional={"tool_calls": ANY_JSON, "name": ANY_JSON}), ANY_JSON)
SPECULATION = st.one_of(st.fixed_dictionaries({}, optional={
    "method": st.one_of(st.sampled_from(["auto", "model", "eagle", "ngram", "none"]), ANY_JSON),
    "num_draft_tokens": st.one_of(st.integers(-2, 20), ANY_JSON), "draft_ahead": ANY_JSON, "k": ANY_JSON}), ANY_JSON)


def field_values(model: str) -> dict:
    """Each request field with plausible values (to get past the first check) and arbitrary ones."""
    def either(plausible):
        return st.one_of(plausible, SCALARS, ANY_JSON)

    return {
        "model": either(st.just(model)),
        "prompt": either(st.one_of(TEXT, st.lists(st.integers(-5, 400), max_size=6), st.lists(TEXT, max_size=2))),
        "messages": either(st.lists(MESSAGE, max_size=3)),
        "max_tokens": either(st.integers(-1, 3)),
        "max_completion_tokens": either(st.integers(-1, 3)),
        "temperature": either(st.floats(0, 2)),
        "top_p": either(st.floats(0, 1)),
        "top_k": either(st.integers(-1, 50)),
        "seed": either(st.integers(-(2**64), 2**65)),
        "stop": either(st.one_of(TEXT, st.lists(TEXT, max_size=3))),
        "stop_token_ids": either(st.lists(st.integers(-5, 500), max_size=3)),
        "stream": either(st.booleans()),
        "stream_options": either(st.fixed_dictionaries({}, optional={"include_usage": ANY_JSON})),
        "ignore_eos": either(st.booleans()),
        "return_token_ids": either(st.booleans()),
        "speculation": SPECULATION,
        **{name: ANY_JSON for name in ("n", "best_of", "echo", "suffix", "logprobs", "top_logprobs",
                                       "presence_penalty", "frequency_penalty", "logit_bias", "tools", "functions",
                                       "tool_choice", "function_call", "response_format", "audio", "user")},
    }


@st.composite
def requests(draw, model: str) -> tuple[str, bytes]:
    """A route and a body: arbitrary JSON, arbitrary values in the request's fields, a valid request
    with up to three fields changed to plausible or arbitrary values, or one with a field nested
    deeper than a parser goes."""
    route = draw(st.sampled_from([COMPLETIONS, CHAT]))
    values = field_values(model)
    shape = draw(st.sampled_from(["any", "fields", "valid", "valid", "deep"]))
    if shape == "any":
        return route, json.dumps(draw(ANY_JSON)).encode()
    if shape == "fields":
        return route, json.dumps(draw(st.fixed_dictionaries({}, optional=values))).encode()
    body = {"model": model, "max_tokens": 1}
    if route == COMPLETIONS:
        body["prompt"] = draw(TEXT.filter(bool))
    else:
        body["messages"] = [{"role": "user", "content": draw(TEXT)}]
    if shape == "deep":
        depth = draw(st.one_of(st.integers(1, 50), st.integers(900, 1100), st.integers(1, 150_000)))
        deep = nested(depth, draw(st.sampled_from([b"[", b'{"a":'])))
        return route, json.dumps(body)[:-1].encode() + b', "' + draw(st.sampled_from(sorted(values))).encode() \
            + b'": ' + deep + b"}"
    for name in draw(st.lists(st.sampled_from(sorted(values)), max_size=3, unique=True)):
        body[name] = draw(values[name])
    return route, json.dumps(body).encode()
