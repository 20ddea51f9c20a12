"""The gateway's HTTP front against hostile or broken clients, on a real gateway and verifier (tiny
models) started with small limits: bodies it cannot take (lone surrogates, JSON nested past any
parser, numbers past any float) are 400 naming the field, never 500; requests that do not parse
as HTTP are answered in one log line; only JSON is taken; every request has a deadline; clients
that send their head or body slowly, or sit idle, lose their connection, and the connections are
capped; a fuzz of both POST routes over arbitrary JSON (tests/openai_bodies.py)."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import select
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings

from tests.harness import free_port, start_stack
from tests.openai_bodies import CHAT, COMPLETIONS, nested, requests

API_KEY = "key-for-the-edges"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON_TYPE = {"Content-Type": "application/json"}
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, KEEPALIVE_TIMEOUT_S = 1.0, 1.0, 3.0
MAX_CONNECTIONS = 8
# How long a test waits for the gateway to close a connection: the configured bound, generously.
CLOSE_WITHIN_S = 10.0
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def gateway(tiny_pair, tmp_path_factory):
    """A verifier and a gateway (no drafter: n-gram drafts) whose requests generate at most two
    tokens, with the HTTP limits small enough to wait out."""
    logs = tmp_path_factory.mktemp("http-edges")
    keys = logs / "api-keys"
    keys.write_text(f"{API_KEY}\n")
    http_port = free_port()
    stack = start_stack(tiny_pair[1], None, logs, gateway_args=[
        "--http-port", str(http_port), "--api-keys-file", str(keys),
        "--max-new-tokens-cap", "2", "--default-max-new-tokens", "1", "--max-prompt-tokens", "64",
        "--http-header-timeout", str(HEADER_TIMEOUT_S), "--http-body-timeout", str(BODY_TIMEOUT_S),
        "--http-keepalive-timeout", str(KEEPALIVE_TIMEOUT_S), "--http-max-connections", str(MAX_CONNECTIONS),
        "--http-request-timeout", "60", "--http-max-request-timeout", "120"])
    stack.http_port = http_port
    stack.model = str(tiny_pair[1])
    yield stack
    stack.stop()


def post(gateway, path: str, body, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """POST ``body`` (bytes, or a value sent as JSON, lone surrogates as JSON escapes) with the API key
    and a JSON content type unless ``headers`` say otherwise: status, headers, body."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=60)
    try:
        connection.request("POST", path, data, {**AUTH, **JSON_TYPE, **(headers or {})})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def assert_openai_error(body: bytes, status: int | None = None) -> dict:
    """``body`` is OpenAI's error shape; its ``error`` object."""
    error = json.loads(body)["error"]
    assert set(error) == ERROR_FIELDS, error
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return error


LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")  # how each record of the log begins


def new_log(gateway, before: int) -> str:
    """What the gateway logged after ``before`` characters (once its lines settle)."""
    time.sleep(0.3)
    return gateway.gateway.log()[before:]


def chat(content) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}


# -- bodies the front cannot take: 400 naming the field ------------------------------------------
LONE_SURROGATES = [
    ("prompt", COMPLETIONS, {"prompt": "fine \ud800 then", "max_tokens": 1}, "prompt"),
    ("prompt in a batch of one", COMPLETIONS, {"prompt": ["\udfff"], "max_tokens": 1}, "prompt"),
    ("message content", CHAT, chat("hi \udc00"), "messages[0].content"),
    ("content part", CHAT, chat([{"type": "text", "text": "ok"}, {"type": "text", "text": "\ud83d"}]),
     "messages[0].content[1].text"),
    ("role", CHAT, {"messages": [{"role": "\ud800", "content": "hi"}], "max_tokens": 1}, "messages[0].role"),
    ("stop string", COMPLETIONS, {"prompt": "the quick", "stop": ["ok", "\ud800"], "max_tokens": 1}, "stop"),
    ("one stop string", CHAT, {**chat("hi"), "stop": "\udbff"}, "stop"),
    ("draft method", CHAT, {**chat("hi"), "speculation": {"method": "\ud800"}}, "speculation.method"),
]


@pytest.mark.parametrize("name,path,body,param", LONE_SURROGATES, ids=[c[0] for c in LONE_SURROGATES])
def test_a_lone_surrogate_is_400_naming_the_field(gateway, name, path, body, param):
    before = len(gateway.gateway.log())
    status, _, answer = post(gateway, path, body)
    error = assert_openai_error(answer)
    assert status == 400 and error["param"] == param and error["message"].startswith(param), error
    assert "Traceback" not in new_log(gateway, before)


NOT_TAKEN = [
    # (name, path, raw body, param)
    ("100 000 brackets", COMPLETIONS, b"[" * 100_000, None),
    ("100 000 objects", CHAT, b'{"a":' * 100_000, None),
    ("a field nested 900 deep", COMPLETIONS, b'{"prompt": "x", "max_tokens": ' + nested(900, b"[") + b"}",
     "max_tokens"),
    ("a model nested 900 deep", CHAT, b'{"model": ' + nested(900, b'{"a":') + b', "messages": []}', "model"),
    ("NaN", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', None),
    ("Infinity", COMPLETIONS, b'{"prompt": "x", "top_p": -Infinity}', None),
    ("a float past float64", COMPLETIONS, b'{"prompt": "x", "temperature": 1e400}', "temperature"),
    ("an integer past float64", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": 1'
     + b"0" * 400 + b"}", "top_p"),
    ("an integer of 5000 digits", COMPLETIONS, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    ("a huge max_tokens", COMPLETIONS, b'{"prompt": "x", "max_tokens": 1' + b"0" * 4000 + b"}", "max_tokens"),
    ("a huge seed", COMPLETIONS, b'{"prompt": "x", "seed": -1' + b"0" * 4000 + b"}", "seed"),
    ("not UTF-8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    ("a non-string model", CHAT, b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', "model"),
    ("include_usage not a boolean", COMPLETIONS,
     b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}}', "stream_options.include_usage"),
]


@pytest.mark.parametrize("name,path,body,param", NOT_TAKEN, ids=[c[0] for c in NOT_TAKEN])
def test_what_the_front_cannot_take_is_400_in_openai_shape(gateway, name, path, body, param):
    before = len(gateway.gateway.log())
    status, headers, answer = post(gateway, path, body)
    assert status == 400 and headers["Content-Type"].startswith("application/json"), answer[:300]
    error = assert_openai_error(answer)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "Traceback" not in new_log(gateway, before)


# -- requests that do not parse as HTTP: answered, one log line -----------------------------------
def raw_exchange(port: int, request: bytes, timeout: float = 30.0) -> bytes:
    """Send ``request`` on a new connection and read until the gateway closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(request)
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
        return received


def split_response(raw: bytes) -> tuple[int, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


UNPARSABLE = [
    ("a 100 kB header", b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"),
    ("a header with control characters", b"GET /v1/models HTTP/1.1\r\nHost: g\r\n"
     b"X-Forged: ok\x1b[2J\rINFO forged line\r\n\r\n"),
    ("not HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 hello\n\nINFO forged line\r\n\r\n"),
]


@pytest.mark.parametrize("name,request_bytes", UNPARSABLE, ids=[c[0] for c in UNPARSABLE])
def test_a_request_that_does_not_parse_is_400_and_one_log_line(gateway, name, request_bytes):
    before = len(gateway.gateway.log())
    status, body = split_response(raw_exchange(gateway.http_port, request_bytes))
    assert status in (400, 431)
    assert_openai_error(body)
    logged = new_log(gateway, before)
    # One line (every line a log record's own: no traceback, no line the client's bytes began) ...
    assert [line for line in logged.splitlines() if "does not parse" in line], logged
    assert all(LOG_RECORD.match(line) for line in logged.splitlines()), logged
    assert "\x1b" not in logged and "\r" not in logged  # ... with nothing that could hide one on a terminal


# -- only JSON bodies -------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain; charset=utf-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "application/jsonp", "application/json-seq"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_body_that_is_not_declared_json_is_415(gateway, content_type, path):
    body = {"prompt": "the quick", "max_tokens": 1} if path == COMPLETIONS else chat("hi")
    headers = {"Content-Type": content_type} if content_type else {}
    data = json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=60)
    try:
        # http.client adds no Content-Type of its own: None sends none.
        connection.putrequest("POST", path)
        for name, value in {**AUTH, **headers, "Content-Length": str(len(data))}.items():
            connection.putheader(name, value)
        connection.endheaders(data)
        response = connection.getresponse()
        status, answer = response.status, response.read()
    finally:
        connection.close()
    assert status == 415
    assert assert_openai_error(answer)["code"] == "unsupported_media_type"


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON",
                                          "application/vnd.api+json"])
def test_json_content_types_are_taken(gateway, content_type):
    status, _, answer = post(gateway, COMPLETIONS, {"prompt": "the quick", "max_tokens": 1},
                             {"Content-Type": content_type})
    assert status == 200, answer
    assert json.loads(answer)["usage"]["completion_tokens"] == 1


# -- deadlines --------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_past_its_deadline_is_504(gateway, stream):
    body = {"prompt": "the quick brown fox", "max_tokens": 2, "stream": stream}
    status, _, answer = post(gateway, COMPLETIONS, body, {"X-Request-Timeout": "0.000001"})
    error = assert_openai_error(answer)
    assert status == 504 and error["code"] == "timeout" and error["type"] == "server_error", error
    # A client may not raise its deadline past the maximum: asked for more, it gets the maximum (and serves).
    status, _, answer = post(gateway, COMPLETIONS, {**body, "stream": False}, {"X-Request-Timeout": "1e9"})
    assert status == 200, answer


@pytest.mark.parametrize("value", ["soon", "-1", "0", "nan", "inf"])
def test_a_deadline_that_is_not_a_positive_number_is_400(gateway, value):
    status, _, answer = post(gateway, CHAT, chat("hi"), {"X-Request-Timeout": value})
    assert status == 400 and assert_openai_error(answer)["param"] == "X-Request-Timeout"


class _ScriptedCore:
    """A request path that commits ``chunks`` tokens of ``text`` (None: without end), then never ends
    (a hung verifier): what the front does at the deadline, alone. Records what ``time_remaining``
    said at the start, and how many generations were closed."""

    model_name = "fake-model"
    serving = True

    def __init__(self, chunks: int | None, text: str = "x") -> None:
        self.chunks = chunks
        self.text = text
        self.remaining: list[float] = []
        self.closed = 0

    def rejected_invalid(self) -> None:
        pass

    def request_telemetry(self, request, attributes):
        class Telemetry:
            def fail(self, exc):
                pass

            def set_attributes(self, attributes):
                pass

            def end(self):
                pass

        return Telemetry()

    async def generate(self, request, obs, time_remaining=lambda: None):
        from specdec.completion import Chunk

        self.remaining.append(time_remaining())
        try:
            chunk = 0
            while self.chunks is None or chunk < self.chunks:
                yield Chunk([5], self.text)
                chunk += 1
            await asyncio.Event().wait()
        finally:
            self.closed += 1


async def test_the_deadline_goes_down_the_request_path_and_ends_a_stalled_one():
    import openai

    from gateway.http import HttpFront
    from gateway.http_limits import HttpLimits
    from specdec.rpc.server import ServeOptions

    core = _ScriptedCore(chunks=2)
    front = HttpFront(core, ServeOptions(), HttpLimits(request_timeout_s=0.5, max_request_timeout_s=2.0))
    port = await front.start("127.0.0.1", free_port())
    messages = [{"role": "user", "content": "hi"}]
    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                      timeout=30) as api:
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as info:
                await api.chat.completions.create(model="fake-model", messages=messages)
            assert info.value.status_code == 504 and info.value.code == "timeout"
            assert time.monotonic() - started < CLOSE_WITHIN_S
            # Streamed: the tokens so far, then the deadline's error as the last event.
            stream = await api.chat.completions.create(model="fake-model", messages=messages, stream=True,
                                                       extra_headers={"X-Request-Timeout": "1000"})
            received = []
            with pytest.raises(openai.APIError) as info:
                async for chunk in stream:
                    received.append(chunk.choices[0].delta.content)
            assert received == ["x", "x"] and info.value.code == "timeout"
    finally:
        await front.close()
    # The default deadline, then the client's asked 1000 s held to the maximum, reached the request path.
    assert 0 < core.remaining[0] <= 0.5 and 0.5 < core.remaining[1] <= 2.0
    assert core.closed == 2  # both generations were cancelled (their sessions freed)


async def test_a_client_that_stops_reading_its_stream_is_cut_off_at_the_deadline(monkeypatch):
    from gateway import http as http_front
    from gateway.http_limits import HttpLimits
    from specdec.rpc.server import ServeOptions

    monkeypatch.setattr(http_front, "LAST_EVENT_S", 0.5)
    core = _ScriptedCore(chunks=None, text="y" * 65536)  # a stream far larger than any socket buffer
    front = http_front.HttpFront(core, ServeOptions(), HttpLimits(request_timeout_s=1.0))
    port = await front.start("127.0.0.1", free_port())
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")  # then reads nothing more
        deadline = time.monotonic() + CLOSE_WITHIN_S
        while not core.closed and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert core.closed == 1  # the generation ended at the deadline, though no write went through
        writer.close()
    finally:
        await front.close()


# -- slow and idle clients, and the connection cap -------------------------------------------------
def trickle(port: int, data: bytes, interval_s: float = 0.2, first: bytes = b"") -> tuple[bytes, float | None]:
    """Send ``first`` at once, then ``data`` a byte every ``interval_s``, reading all the while: what
    came back, and the seconds from the first trickled byte until the gateway closed the connection
    (None: still open once all was sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(first)
        received, started = b"", time.monotonic()
        for byte in data:
            try:
                connection.sendall(bytes([byte]))
            except OSError:  # reset: it closed
                return received, time.monotonic() - started
            wait_until = time.monotonic() + interval_s
            while (left := wait_until - time.monotonic()) > 0:
                if select.select([connection], [], [], left)[0]:
                    try:
                        chunk = connection.recv(65536)
                    except ConnectionResetError:
                        chunk = b""
                    if not chunk:
                        return received, time.monotonic() - started
                    received += chunk
        return received, None


def test_a_client_trickling_its_head_is_closed_with_408(gateway):
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}").encode()
    assert len(head) * 0.2 > CLOSE_WITHIN_S  # it would take longer than the bound to send it all
    received, closed_after = trickle(gateway.http_port, head)
    assert closed_after is not None and closed_after < CLOSE_WITHIN_S
    status, body = split_response(received)
    assert status == 408 and "head" in assert_openai_error(body)["message"]


def test_a_client_trickling_its_body_is_closed_with_408(gateway):
    body = json.dumps({"prompt": "the quick brown fox " * 3, "max_tokens": 1}).encode()
    assert len(body) * 0.2 > CLOSE_WITHIN_S
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    received, closed_after = trickle(gateway.http_port, body, first=head)
    assert closed_after is not None and closed_after < CLOSE_WITHIN_S
    status, answer = split_response(received)
    assert status == 408 and "body" in assert_openai_error(answer)["message"]


def wait_closed(connection: socket.socket, limit_s: float) -> float | None:
    """Seconds until the peer closes ``connection`` (None: not within ``limit_s``); discards data."""
    started = time.monotonic()
    connection.settimeout(limit_s)
    try:
        while connection.recv(65536):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def test_idle_connections_are_closed(gateway):
    with socket.create_connection(("127.0.0.1", gateway.http_port), timeout=30) as silent:
        assert wait_closed(silent, CLOSE_WITHIN_S) is not None  # opened, never sent a byte
    with socket.create_connection(("127.0.0.1", gateway.http_port), timeout=30) as kept_alive:
        kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        answer = b""
        while not re.search(rb"\r\n\r\n\{.*\}", answer, re.DOTALL):
            answer += kept_alive.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200") and b"Connection: close" not in answer  # kept alive ...
        assert wait_closed(kept_alive, CLOSE_WITHIN_S) is not None  # ... until idle too long


def test_connections_past_the_cap_are_refused_at_once(gateway):
    sockets = [socket.create_connection(("127.0.0.1", gateway.http_port), timeout=30)
               for _ in range(MAX_CONNECTIONS + 3)]
    try:
        # The refused ones are answered and closed without sending anything; the others wait for a request.
        refused = set()
        deadline = time.monotonic() + 1.5  # well within the keep-alive timeout
        while (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([s for s in sockets if s not in refused], [], [], left)
            for s in readable:
                status, body = split_response(s.recv(65536))
                assert status == 503 and assert_openai_error(body)["code"] == "service_unavailable"
                assert wait_closed(s, CLOSE_WITHIN_S) is not None
                refused.add(s)
        served = [s for s in sockets if s not in refused]
        assert len(refused) >= 3 and 1 <= len(served) <= MAX_CONNECTIONS
        assert all(sockets.index(s) > sockets.index(a) for s in refused for a in served)  # the later ones
        for s in served:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n")
            status, _ = split_response(s.recv(65536))
            assert status == 200
    finally:
        for s in sockets:
            s.close()
    # Closed connections free their places.
    deadline = time.monotonic() + CLOSE_WITHIN_S
    while True:
        try:
            status, _ = split_response(raw_exchange(gateway.http_port, b"GET /health HTTP/1.1\r\nHost: g\r\n"
                                                                      b"Connection: close\r\n\r\n"))
        except OSError:
            status = None
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status == 200


# -- a fuzz of both POST routes over arbitrary JSON -----------------------------------------------
def check_answer(status: int, headers: dict, answer: bytes) -> None:
    assert status in (200, 400, 404), (status, answer[:500])
    if status != 200:
        assert headers["Content-Type"].startswith("application/json")
        assert_openai_error(answer)
    elif headers["Content-Type"].startswith("text/event-stream"):
        events = [line.removeprefix(b"data: ") for line in answer.split(b"\n\n") if line]
        assert events, answer
        for event in events[:-1]:
            assert "choices" in json.loads(event)
        if events[-1] != b"[DONE]":  # an error after the stream began is its last event
            assert_openai_error(events[-1])
    else:
        assert json.loads(answer)["choices"]


FUZZ_EXAMPLES = 1200


def test_fuzz_both_post_routes_never_500(gateway):
    seen = {}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=requests(gateway.model))
    def fuzz(request):
        route, body = request
        status, headers, answer = post(gateway, route, body)
        seen[status] = seen.get(status, 0) + 1
        check_answer(status, headers, answer)

    before = len(gateway.gateway.log())
    fuzz()
    assert seen.get(200, 0) > FUZZ_EXAMPLES // 20 and seen.get(400), seen  # generations and refusals both
    logged = gateway.gateway.log()[before:]
    assert "Traceback" not in logged and "internal error" not in logged
