"""The gateway's OpenAI-compatible HTTP API, driven by the official ``openai`` client against real
services on loopback (tiny models): whole and streamed chat and completions, usage, stop strings,
seeds, the same tokens as the gRPC API, errors in OpenAI's shape with their statuses, a disconnect
that frees the sessions, and the request's trace."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from gateway import openai_api
from specdec.client import GatewayClient
from specdec.rpc.server import status_details
from specdec.wire_types import FieldError
from tests.harness import free_port, scrape_metric, start_service, start_stack
from tests.test_security import make_pki
from tests.test_tracing import GATEWAY, Receiver

API_KEY = "test-key-for-the-http-api"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count to five"}]
CHAT_PAIRS = [(m["role"], m["content"]) for m in CHAT]
PROMPT = "the quick brown fox"
NEW_TOKENS = 24
# A generation that runs on while a test disconnects (or holds a session): about a second of the
# tiny models' decoding, and within their 1024-position context.
LONG = 900
# Fixed draft length: the same rounds on both APIs (and a seeded sample that repeats bit for bit).
SPECULATION = {"method": "model", "num_draft_tokens": 3}


@pytest.fixture(scope="module")
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def stack(tiny_pair, tmp_path_factory, receiver):
    logs = tmp_path_factory.mktemp("http-logs")
    keys = logs / "api-keys"
    keys.write_text(f"{API_KEY}\n")
    http_port = free_port()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}", "OTEL_BSP_SCHEDULE_DELAY": "100",
           "OTEL_METRICS_EXPORTER": "none"}
    stack = start_stack(tiny_pair[1], tiny_pair[2], logs, metrics=True, env=env,
                        gateway_args=["--http-port", str(http_port), "--api-keys-file", str(keys)])
    stack.http_port = http_port
    stack.model = str(tiny_pair[1])
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(stack):
    # No retries: a 429 or 503 must reach the test as it was answered.
    with openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=API_KEY, max_retries=0,
                       timeout=120) as client:
        yield client


def grpc_result(stack, **kwargs):
    with GatewayClient(stack.gateway.address, timeout=120, api_key=API_KEY) as grpc_client:
        return grpc_client.generate(**kwargs)


def extras(**more) -> dict:
    """The request's extension fields (``extra_body``): vLLM's and specdec's."""
    return {"ignore_eos": True, "return_token_ids": True, "speculation": SPECULATION, **more}


def call(stack, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    """A raw request (no client; a POST with ``body``): the status and the JSON answer."""
    request = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}{path}", data=body,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_lists_the_target_and_health_is_open(stack, client):
    assert [m.id for m in client.models.list().data] == [stack.model]
    assert client.models.retrieve(stack.model).id == stack.model
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/health", timeout=10) as response:
        assert response.status == 200 and json.loads(response.read()) == {"status": "serving"}


def test_chat_is_token_identical_to_the_grpc_api(stack, client):
    response = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=NEW_TOKENS,
                                              temperature=0, extra_body=extras())
    expected = grpc_result(stack, messages=CHAT_PAIRS, max_new_tokens=NEW_TOKENS, ignore_eos=True, **SPECULATION)
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model == stack.model
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.token_ids == expected.token_ids and len(expected.token_ids) == NEW_TOKENS
    assert choice.finish_reason == "length" and choice.index == 0
    assert response.prompt_token_ids == expected.prompt_token_ids
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == NEW_TOKENS
    assert response.usage.total_tokens == len(expected.prompt_token_ids) + NEW_TOKENS
    stats = response.speculation_stats
    assert stats["draft_method"] == "model" and stats["k_history"] == expected.stats["k_history"]
    assert stats["draft_tokens"] == expected.stats["draft_tokens"] > 0


def test_completion_is_token_identical_to_the_grpc_api(stack, client):
    response = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                         extra_body=extras())
    expected = grpc_result(stack, prompt=PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, **SPECULATION)
    choice = response.choices[0]
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert choice.text == expected.text and choice.token_ids == expected.token_ids
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == NEW_TOKENS
    # Token ids as the prompt: the same request.
    by_ids = client.completions.create(model=stack.model, prompt=expected.prompt_token_ids, max_tokens=NEW_TOKENS,
                                       temperature=0, extra_body=extras())
    assert by_ids.choices[0].token_ids == expected.token_ids


def test_streamed_chat_carries_the_same_tokens_then_usage(stack, client):
    whole = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=NEW_TOKENS, temperature=0,
                                           extra_body=extras())
    chunks = list(client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=NEW_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extras()))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    content = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(content) > 1 and len(finish) == 1
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in content) == whole.choices[0].message.content
    assert [t for c in content for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    assert finish[0].choices[0].finish_reason == "length"
    assert finish[0].speculation_stats["draft_method"] == "model"
    # The usage chunk comes last, with no choices; the others carry usage null.
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completion_without_usage(stack, client):
    whole = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body=extras())
    chunks = list(client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                            stream=True, extra_body=extras()))
    assert all(c.object == "text_completion" and c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_string_cuts_the_text_and_finishes_with_stop(stack, client, stream):
    free = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                     extra_body=extras()).choices[0]
    text = free.text
    # Two printable ASCII characters from the later part (the tiny model also writes broken UTF-8).
    stop = next(text[i:i + 2] for i in range(len(text) // 3, len(text) - 1)
                if text[i:i + 2].isascii() and text[i:i + 2].isprintable())
    response = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                         stop=[stop, "never-generated-by-this-model"], stream=stream,
                                         extra_body=extras())
    if stream:
        chunks = list(response)
        out, finish_reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        out, finish_reason = response.choices[0].text, response.choices[0].finish_reason
    assert out == text[: text.index(stop)]
    assert finish_reason == "stop"


def test_seeded_sampling_repeats_and_seeds_differ(stack, client):
    def sample(seed: int) -> list[int]:
        response = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=NEW_TOKENS,
                                                  temperature=1.0, top_p=0.95, seed=seed, extra_body=extras())
        return response.choices[0].token_ids

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first
    # ... and the same seed through the gRPC API draws the same sample.
    grpc_sample = grpc_result(stack, messages=CHAT_PAIRS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                              temperature=1.0, top_p=0.95, seed=7, **SPECULATION)
    assert grpc_sample.token_ids == first


BAD_REQUESTS = [
    # (name, endpoint, request fields, status, param)
    ("two choices", "chat", dict(n=2), 400, "n"),
    ("negative temperature", "chat", dict(temperature=-1), 400, "temperature"),
    ("top_p above one", "chat", dict(top_p=1.5), 400, "top_p"),
    ("max_tokens over the cap", "chat", dict(max_tokens=10**6), 400, "max_tokens"),
    ("max_completion_tokens over the cap", "chat", dict(max_completion_tokens=10**6), 400, "max_completion_tokens"),
    ("max_tokens zero", "completion", dict(max_tokens=0), 400, "max_tokens"),
    ("unknown role", "chat", dict(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("image part", "chat",
     dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content[0]"),
    ("no messages", "chat", dict(messages=[]), 400, "messages"),
    ("too many stop strings", "completion", dict(stop=[str(i) for i in range(100)]), 400, "stop"),
    ("seed not an integer", "completion", dict(extra_body={"seed": "abc"}), 400, "seed"),
    ("logprobs", "chat", dict(logprobs=True), 400, "logprobs"),
    ("tools", "chat", dict(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("two prompts", "completion", dict(prompt=["a", "b"]), 400, "prompt"),
    ("empty prompt", "completion", dict(prompt=""), 400, "prompt"),
    ("token id beyond the vocabulary", "completion", dict(prompt=[1, 10**6]), 400, "prompt"),
    ("unknown draft method", "chat", dict(extra_body={"speculation": {"method": "telepathy"}}), 400,
     "speculation.method"),
    ("too many draft tokens", "chat", dict(extra_body={"speculation": {"num_draft_tokens": 10**4}}), 400,
     "speculation.num_draft_tokens"),
    ("unknown speculation field", "chat", dict(extra_body={"speculation": {"k": 3}}), 400, "speculation.k"),
    ("another model", "chat", dict(model="gpt-4o"), 404, "model"),
]


@pytest.mark.parametrize("name,endpoint,fields,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_are_answered_in_openai_shape(stack, client, name, endpoint, fields, status, param):
    request = {"model": stack.model, "max_tokens": 4, **fields}
    with pytest.raises(openai.APIStatusError) as info:
        if endpoint == "chat":
            client.chat.completions.create(**{"messages": CHAT, **request})
        else:
            client.completions.create(**{"prompt": PROMPT, **request})
    error = info.value
    assert error.status_code == status
    assert error.param == param
    assert error.type == "invalid_request_error"
    assert error.body["message"].startswith(param) or status == 404
    if status == 404:
        assert error.code == "model_not_found"
    # ... and the gateway still serves.
    ok = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=3, extra_body=extras())
    assert ok.usage.completion_tokens == 3


def test_a_body_that_is_not_json_is_400(stack):
    status, body = call(stack, "/v1/chat/completions", b"{not json", {"Authorization": f"Bearer {API_KEY}"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_missing_or_wrong_api_key_is_401(stack):
    body = json.dumps({"model": stack.model, "prompt": PROMPT, "max_tokens": 2}).encode()
    status, answer = call(stack, "/v1/completions", body)
    assert status == 401
    assert answer["error"]["code"] == "invalid_api_key" and "missing" in answer["error"]["message"]
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    status, answer = call(stack, "/v1/models", headers={"Authorization": "Bearer not-the-key"})
    assert status == 401 and answer["error"]["message"] == "invalid API key"
    with openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="not-the-key",
                       max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=2)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()


ACTIVE_SESSIONS = 'specdec_active_sessions{{role="{}"}}'


def wait_until_no_sessions(stack) -> None:
    """Poll every service's ``specdec_active_sessions`` until all are 0 (or 30 s passed), then check."""
    roles = [(stack.verifiers[0], "verifier"), (stack.drafters[0], "drafter"), (stack.gateway, "gateway")]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(scrape_metric(s, ACTIVE_SESSIONS.format(r)) for s, r in roles):
        time.sleep(0.05)
    for service, role in roles:
        assert scrape_metric(service, ACTIVE_SESSIONS.format(role)) == 0, role


def assert_cut_short(span) -> None:
    """The request's span ended on the disconnect, not on a finished generation."""
    assert span.attrs["error.type"] in ("cancelled", "ClientConnectionResetError"), span.attrs
    assert "gen_ai.usage.output_tokens" not in span.attrs


def test_disconnect_mid_stream_frees_every_session(stack, client, receiver):
    stream = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=LONG, temperature=0,
                                            stream=True, extra_body=extras(speculation={"method": "model",
                                                                                        "num_draft_tokens": 2}))
    first = next(stream)
    next(stream)
    assert scrape_metric(stack.verifiers[0], ACTIVE_SESSIONS.format("verifier")) == 1
    stream.close()  # closes the connection mid-stream
    wait_until_no_sessions(stack)
    span, _ = receiver.wait_for_trace(first.id, {GATEWAY})
    assert_cut_short(span)


def test_disconnect_before_a_whole_response_cancels_the_generation(stack, receiver):
    """Nothing is written to a client waiting for a whole response: the disconnect itself must end it."""
    body = json.dumps({"model": stack.model, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", stack.http_port), timeout=30) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                           b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while scrape_metric(stack.verifiers[0], ACTIVE_SESSIONS.format("verifier")) == 0:
            assert time.monotonic() < deadline, "the generation never started"
            time.sleep(0.02)
    wait_until_no_sessions(stack)
    deadline = time.monotonic() + 30
    spans = []
    while time.monotonic() < deadline and not spans:
        with receiver.lock:
            spans = [s for s in receiver.spans if s.attrs.get("http.route") == "/v1/completions"
                     and s.attrs.get("gen_ai.request.max_tokens") == LONG]
        time.sleep(0.1)
    assert len(spans) == 1
    assert_cut_short(spans[0])


def test_http_requests_are_traced_and_counted_like_grpc_ones(stack, client, receiver):
    requests_before = scrape_metric(stack.gateway, 'specdec_requests_total{role="gateway"}')
    response = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=6, temperature=0,
                                              extra_body=extras())
    assert scrape_metric(stack.gateway, 'specdec_requests_total{role="gateway"}') == requests_before + 1
    with pytest.raises(openai.BadRequestError) as refusal:  # by the request path, after its span began
        client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=4,
                                  extra_body={"speculation": {"method": "telepathy"}})
    refused_id = refusal.value.response.headers["x-request-id"]
    grpc_result(stack, prompt=PROMPT, max_new_tokens=4, request_id="grpc-beside-http")

    ok, _ = receiver.wait_for_trace(response.id, {GATEWAY})
    assert ok.attrs["http.route"] == "/v1/chat/completions" and ok.attrs["http.request.method"] == "POST"
    assert ok.attrs["http.response.status_code"] == 200
    assert ok.attrs["gen_ai.operation.name"] == "chat" and ok.attrs["gen_ai.response.id"] == response.id
    assert ok.attrs["gen_ai.usage.output_tokens"] == response.usage.completion_tokens
    assert ok.attrs["specdec.rounds"] == response.speculation_stats["rounds"]
    refused, _ = receiver.wait_for_trace(refused_id, {GATEWAY})
    assert refused.attrs["http.route"] == "/v1/completions" and refused.attrs["http.response.status_code"] == 400
    assert refused.attrs["error.type"] == "FieldError"  # a request's bad field (specdec.wire_types)
    grpc_span, _ = receiver.wait_for_trace("grpc-beside-http", {GATEWAY})
    assert grpc_span.attrs["rpc.system"] == "grpc" and grpc_span.attrs["rpc.method"] == "Generate"
    assert "http.route" not in grpc_span.attrs


def test_over_capacity_is_429_and_no_verifier_is_503(stack, tiny_pair, tmp_path):
    """A gateway of one session beside the stack's verifier, and one with no verifier at all."""
    http_port, lonely_port = free_port(), free_port()
    small = start_service("gateway", ["--target", str(tiny_pair[1]), "--verifier", stack.verifiers[0].address,
                                      "--max-sessions", "1", "--http-port", str(http_port)], tmp_path, name="small")
    lonely = start_service("gateway", ["--target", str(tiny_pair[1]), "--verifier", f"127.0.0.1:{free_port()}",
                                       "--verifier-wait", "0", "--http-port", str(lonely_port)], tmp_path,
                           name="lonely")
    try:
        small.wait_serving()
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0) as one:
            with one.completions.create(model=str(tiny_pair[1]), prompt=PROMPT, max_tokens=LONG, stream=True,
                                        extra_body={"ignore_eos": True}) as held:
                next(iter(held))  # the one session is taken
                with pytest.raises(openai.RateLimitError) as info:
                    one.completions.create(model=str(tiny_pair[1]), prompt=PROMPT, max_tokens=2)
                assert info.value.status_code == 429 and info.value.code == "rate_limit_exceeded"
                assert "capacity" in info.value.body["message"]
        deadline = time.monotonic() + 60  # HTTP listens from the start; requests wait for no one here
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{lonely_port}/health", timeout=5):
                    pass
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and json.loads(exc.read()) == {"status": "not_serving"}
                break
            except OSError:
                assert time.monotonic() < deadline, lonely.log()
                time.sleep(0.2)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{lonely_port}/v1", api_key="none", max_retries=0) as nobody:
            with pytest.raises(openai.InternalServerError) as info:
                nobody.chat.completions.create(model=str(tiny_pair[1]), messages=CHAT, max_tokens=2)
            assert info.value.status_code == 503 and info.value.code == "service_unavailable"
            assert "verifier" in info.value.body["message"]
        # Both drain and exit cleanly on SIGTERM, the HTTP front included.
        assert small.stop() == 0 and lonely.stop() == 0
    finally:
        small.stop()
        lonely.stop()


def test_with_tls_flags_the_http_api_is_https_with_client_certificates(tiny_pair, tmp_path):
    pki = make_pki(tmp_path)
    http_port = free_port()
    gateway = start_service("gateway", ["--target", str(tiny_pair[1]), "--verifier", f"127.0.0.1:{free_port()}",
                                        "--tls-cert", str(pki / "service.crt"), "--tls-key", str(pki / "service.key"),
                                        "--tls-ca", str(pki / "ca.crt"), "--tls-client-auth",
                                        "--http-port", str(http_port)], tmp_path)
    url = f"https://localhost:{http_port}/v1/models"
    with_certificate = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    with_certificate.load_cert_chain(str(pki / "service.crt"), str(pki / "service.key"))
    try:
        deadline = time.monotonic() + 60
        while True:  # the HTTP front listens once the gateway has loaded its tokenizer
            try:
                with urllib.request.urlopen(url, timeout=5, context=with_certificate) as response:
                    assert json.loads(response.read())["data"][0]["id"] == str(tiny_pair[1])
                break
            except urllib.error.URLError as exc:
                assert isinstance(exc.reason, ConnectionRefusedError) and time.monotonic() < deadline, gateway.log()
                time.sleep(0.2)
        without_certificate = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            with urllib.request.urlopen(url, timeout=5, context=without_certificate) as response:
                response.read()
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):  # plain HTTP
            urllib.request.urlopen(f"http://localhost:{http_port}/v1/models", timeout=5).read()
    finally:
        gateway.stop()


# -- the translation alone --------------------------------------------------------------------------
def test_gateway_field_names_become_the_request_s():
    api = openai_api.parse_request({"messages": CHAT, "max_completion_tokens": 5, "seed": -1}, openai_api.CHAT,
                                   "m", "id")
    assert api.generation.sampling.seed == 2**64 - 1  # negative seeds wrap to the services' unsigned seed
    assert api.generation.sampling.temperature == openai_api.DEFAULT_TEMPERATURE  # OpenAI's default
    error = openai_api.error_for(FieldError("sampling.max_new_tokens", "9 exceeds the limit of 8"), api.names)
    assert (error.status, error.param, error.message) == (400, "max_completion_tokens",
                                                          "max_completion_tokens: 9 exceeds the limit of 8")
    error = openai_api.error_for(FieldError("messages[3].role", "must be one of system"), api.names)
    assert (error.param, error.message) == ("messages[3].role", "messages[3].role: must be one of system")
    # A bare ValueError names no field, whatever its text says: the field travels as data.
    assert openai_api.error_for(ValueError("prompt: no"), api.names).param is None
    # A downstream refusal's field comes from its status (the rich error's BadRequest), not its text.
    code = grpc.StatusCode.INVALID_ARGUMENT
    details = "sampling.max_new_tokens: 9 exceeds this verifier's cap"
    downstream = grpc.aio.AioRpcError(code, grpc.aio.Metadata(),
                                      grpc.aio.Metadata(*status_details(code, details, "sampling.max_new_tokens")),
                                      details=details)
    error = openai_api.error_for(downstream, api.names)
    assert (error.status, error.param, error.message) == (400, "max_completion_tokens", f"downstream: {details}")
    untagged = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
    assert openai_api.error_for(untagged, api.names).param is None
    # The role passes through as given: the request path maps it, for both fronts (gateway.generation.ROLE_ALIASES).
    assert openai_api.parse_request({"messages": [{"role": "developer", "content": "x"}]}, openai_api.CHAT, "m",
                                    "id").generation.messages == [("developer", "x")]


def test_up_leaves_the_http_api_off_when_port_8000_is_taken():
    import argparse

    from specdec import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser, "embedded")
    gateway_command = up.children(parser.parse_args(["--http-port", "8123"]))[2].command
    assert gateway_command[gateway_command.index("--http-port") + 1] == "8123"
    assert parser.parse_args(["--http-port", "off"]).http_port == 0
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", up.DEFAULT_HTTP_PORT))
            taken.listen()
        except OSError:
            pass  # something else holds it: the same situation
        assert up.default_http_port("127.0.0.1") == 0


class _FailingCore:
    """A request path that commits two tokens and then loses its verifier: what the HTTP front
    does once the response has begun, alone (no services)."""

    model_name = "fake-model"
    serving = True

    def __init__(self) -> None:
        self.failures: list[BaseException] = []
        self.closed = False

    def rejected_invalid(self) -> None:
        pass

    def request_telemetry(self, request, attributes):
        core = self

        class Telemetry:
            def fail(self, exc):
                core.failures.append(exc)

            def set_attributes(self, attributes):
                pass

            def end(self):
                pass

        return Telemetry()

    async def generate(self, request, obs, time_remaining=None):
        from specdec.completion import Chunk
        from specdec.rpc.server import NotReady

        try:
            yield Chunk([5], "Hel")
            yield Chunk([6], "lo")
            raise NotReady("verifier 10.0.0.7:50053 is gone and no other is ready")
        finally:
            self.closed = True


async def test_an_error_after_the_stream_began_is_its_last_event():
    from gateway.http import HttpFront
    from specdec.rpc.server import ServeOptions

    core = _FailingCore()
    front = HttpFront(core, ServeOptions())
    port = await front.start("127.0.0.1", free_port())
    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as api:
            stream = await api.chat.completions.create(model="fake-model", messages=CHAT, stream=True)
            received = []
            with pytest.raises(openai.APIError) as info:
                async for chunk in stream:
                    received.append(chunk.choices[0].delta.content)
            assert received == ["Hel", "lo"]
            assert "verifier 10.0.0.7:50053 is gone" in info.value.message
            assert info.value.code == "service_unavailable"
    finally:
        await front.close()
    assert core.closed and [type(e).__name__ for e in core.failures] == ["NotReady"]
