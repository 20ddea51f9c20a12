"""How the gateway's downstream streams end under a request, and what a hostile request costs.

- A drafter stream that ends mid-request (cancelled by the drafter, cancelled beneath the link, a
  write to a stream that already finished, a reset connection) leaves the request exact at k = 0.
- A verifier stream that ends with no other replica is UNAVAILABLE (never INTERNAL or UNKNOWN);
  with a replica, the session migrates and stays exact.
- The gateway mints its own downstream session ids.
- A 4 MB prompt is refused before tokenizing and does not stall other streams; bytes that are not
  UTF-8 are INVALID_ARGUMENT, naming the field, and a caller without a key is UNAUTHENTICATED,
  neither with a traceback in the gateway's log.
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from gateway.links import RemoteDrafter
from gateway.migration import MigratingVerifier, VerifierUnavailable
from gateway.requests import bad_utf8_field
from gateway.pools import ReplicaPool
from specdec.client import ChunkEvent, FinalEvent, GatewayClient, build_request
from specdec.completion import CompletionBuilder
from specdec.engine import GenerationResult, LocalVerifier, generate
from specdec.policy import FixedDraftLength
from specdec.rpc.server import DEFAULT_MAX_MESSAGE_BYTES, status_for
from specdec.wire_types import SamplingParams
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.verification import TargetSession
from tests.harness import ROOT, start_service
from tests.test_services import reference_greedy
from tests.tiny_models import build_noisy_copy

API_KEY = "fault-key-0123456789"
PROMPT_IDS = [5, 17, 42, 9, 77, 3]


@pytest.fixture(scope="module")
def noisy_draft(tiny_pair, tmp_path_factory):
    return build_noisy_copy(tmp_path_factory.mktemp("noisy") / "draft", tiny_pair[1], noise_std=0.3)


class ResettingProxy:
    """A TCP forwarder to ``upstream``; ``reset()`` ends every open connection with an RST (a peer
    whose connection is reset mid-request), while new connections keep being forwarded."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.pairs.append((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def reset(self) -> int:
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for client, server in pairs:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            client.close()  # RST to the gateway
            server.close()
        return len(pairs)

    def close(self) -> None:
        self.listener.close()
        self.reset()


def serving(*services) -> None:
    try:
        for service in services:
            service.wait_serving()
    except Exception:
        for service in services:
            service.stop()
        raise


def gateway_over(tiny_pair, tmp_path, verifiers: list[str], drafters: list[str] = (), args=(), env=None):
    cmd = ["--target", str(tiny_pair[1]), *args]
    for address in verifiers:
        cmd += ["--verifier", address]
    for address in drafters:
        cmd += ["--drafter", address]
    return start_service("gateway", cmd, tmp_path, env=env)


def traceback_free(log: str) -> None:
    assert "Traceback" not in log and " ERROR " not in log, log[-4000:]


# -- the links in-process, over real services -------------------------------------------------------

def run_loop(verifier, drafter, params: SamplingParams, target, k: int, on_round=None) -> GenerationResult:
    async def go():
        result = None
        completion = CompletionBuilder(target.tokenizer, params, target.eos_token_ids)
        async for event in generate(prompt_tokens=len(PROMPT_IDS), completion=completion,
                                    verifier=verifier, drafter=drafter, policy=FixedDraftLength(k),
                                    draft_method="model", on_round=on_round, shadow_probes=False):
            if isinstance(event, GenerationResult):
                result = event
        return result

    return go()


class CancellingDrafter:
    """A ``RemoteDrafter`` whose stream is ended at round ``at`` in one of three ways before the
    proposal is asked for:

    - ``cancel_then_write``: the drafter cancels the session (CancelDraft) and the stream finishes
      before the next write (a write to a finished call: InvalidStateError in grpc.aio);
    - ``cancel_racing``: CancelDraft races the proposal;
    - ``local_cancel``: the call is cancelled beneath the link (CancelledError from grpc, not a
      cancel of the request).
    """

    concurrent = True

    def __init__(self, link: RemoteDrafter, stub, mode: str, at: int) -> None:
        self.link, self.stub, self.mode, self.at = link, stub, mode, at
        self.calls = 0
        self.after: list[int] = []  # drafts proposed once the stream had ended (known before the call)

    async def propose(self, committed, k):
        self.calls += 1
        if self.calls == self.at:
            if self.mode == "cancel_then_write":
                await self.stub.CancelDraft(drafter_pb2.CancelDraftRequest(session_id=self.link.session_id), timeout=5)
                # The stream's end itself: awaiting its status returns once the cancel has ended it
                # (60 s: a hang guard, not a bound on the cancel).
                await asyncio.wait_for(self.link.call.code(), 60)
                assert self.link.call.done()
            elif self.mode == "cancel_racing":
                asyncio.ensure_future(
                    self.stub.CancelDraft(drafter_pb2.CancelDraftRequest(session_id=self.link.session_id), timeout=5))
            else:
                self.link.call.cancel()
        ended = self.link.broken is not None
        proposal = await self.link.propose(committed, k)
        if ended:
            self.after.append(len(proposal))
        return proposal


@pytest.fixture(scope="module")
def drafter_service(noisy_draft, tmp_path_factory):
    service = start_service("drafter", ["--method", "model", "--draft-model", str(noisy_draft)],
                            tmp_path_factory.mktemp("drafter"))
    serving(service)
    yield service
    service.stop()


@pytest.mark.parametrize("mode", ["cancel_then_write", "cancel_racing", "local_cancel"])
def test_drafter_stream_ended_mid_request_continues_exactly_at_k0(drafter_service, tiny_target, mode):
    params = SamplingParams(max_new_tokens=60)
    expected = reference_greedy(tiny_target, PROMPT_IDS, 60)

    async def go():
        async with grpc.aio.insecure_channel(drafter_service.address) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            link = RemoteDrafter(stub, f"fault-{mode}", PROMPT_IDS, params, lambda: 60.0, request_id=f"req-{mode}")
            drafter = CancellingDrafter(link, stub, mode, at=4)
            session = TargetSession(tiny_target, PROMPT_IDS, params)
            try:
                result = await run_loop(LocalVerifier(session), drafter, params, tiny_target, 3)
            finally:
                session.close()
                await link.close()
            return result, link, drafter

    result, link, drafter = asyncio.run(go())
    assert len(expected) == 60  # (no EOS early: the stream ends mid-request)
    assert result.token_ids == expected
    assert result.finish_reason == "length"
    assert link.broken is not None
    # Plain decoding from the moment the link knew: a racing cancel may land a proposal or two late.
    assert drafter.after and all(n == 0 for n in drafter.after), drafter.after
    assert result.stats.draft_tokens > 0  # it did draft before


@pytest.fixture(scope="module")
def two_verifiers(tiny_pair, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("verifiers")
    services = [start_service("verifier", ["--target", str(tiny_pair[1])], log_dir, name=f"v{i}") for i in range(2)]
    serving(*services)
    yield services
    for service in services:
        service.stop()


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("mode", ["cancel_verify", "local_cancel"])
def test_verifier_stream_ended_mid_request_migrates_or_is_unavailable(two_verifiers, tiny_target, replicas, mode):
    params = SamplingParams(max_new_tokens=60)
    expected = reference_greedy(tiny_target, PROMPT_IDS, 60)
    assert len(expected) == 60

    async def go():
        pool = ReplicaPool("verifier", verifier_pb2_grpc.VerifierStub, DEFAULT_MAX_MESSAGE_BYTES)
        pool.set_addresses([v.address for v in two_verifiers[:replicas]])
        await pool.refresh()  # once: no refresh loop runs here, so a failed replica stays unready
        replica = next(b for b in pool.replicas if b.address == two_verifiers[0].address)
        stubs = [replica.stub]
        verifier = MigratingVerifier(pool, replica, f"vfault-{mode}-{replicas}", PROMPT_IDS, params,
                                     lambda: 60.0, request_id="req-v")
        rounds = 0
        ended = asyncio.get_running_loop().create_future()

        def on_round(record):
            nonlocal rounds
            rounds += 1
            if rounds == 5:
                if mode == "cancel_verify":
                    task = asyncio.ensure_future(stubs[0].CancelVerify(
                        verifier_pb2.CancelVerifyRequest(session_id=verifier.session_id), timeout=5))
                    task.add_done_callback(lambda t: ended.set_result(t.exception()))
                else:
                    verifier.link.call.cancel()
                    ended.set_result(None)

        try:
            outcome = await run_loop(verifier, None, params, tiny_target, 0, on_round)
        except VerifierUnavailable as exc:
            outcome = exc
        finally:
            await verifier.close()
            for b in pool.replicas:
                await b.channel.close()
        return outcome, verifier, (await ended if ended.done() else None)

    outcome, verifier, cancel_error = asyncio.run(go())
    assert cancel_error is None
    if replicas == 2:
        assert isinstance(outcome, GenerationResult), outcome
        assert outcome.token_ids == expected
        assert verifier.migrations == 1
    else:
        assert isinstance(outcome, VerifierUnavailable), outcome
        assert status_for(outcome) == grpc.StatusCode.UNAVAILABLE
        assert "no verifier replica was ready within 0 s" in str(outcome)


def test_a_replica_dropped_and_readded_by_discovery_is_taken_again_after_a_failure(two_verifiers):
    """A verifier restarted in place (same pod IP) leaves the EndpointSlice while it is not ready and
    comes back as a new Replica: a session that failed on the old one takes the new one (its
    readiness is newer than the failure), instead of waiting out --verifier-wait."""
    address = two_verifiers[0].address

    async def go():
        pool = ReplicaPool("verifier", verifier_pb2_grpc.VerifierStub, DEFAULT_MAX_MESSAGE_BYTES)
        pool.set_addresses([address])
        await pool.refresh()
        old = pool.replicas[0]
        old.in_flight = 1  # a session still open on it: discovery keeps it, marked removed
        failed = {address: old.ready_epoch}
        pool.mark_not_ready(old)
        pool.set_addresses([])  # not ready: out of the slice
        pool.set_addresses([address])  # serving again: back in it, as a new Replica
        await pool.refresh()
        picked = pool.pick(failed=failed)
        for replica in pool.replicas:
            await replica.channel.close()
        return old, picked

    old, picked = asyncio.run(go())
    assert picked is not None and picked is not old and picked.address == address


class _FailingVerifyStub:
    """A verifier stub whose every Verify stream fails at once with INTERNAL (a replica that crashes
    on this request's text), over a real stub for everything else."""

    def __init__(self, stub) -> None:
        self.stub = stub
        self.calls = 0

    def GetInfo(self, *args, **kwargs):
        return self.stub.GetInfo(*args, **kwargs)

    def Verify(self, *args, **kwargs):
        self.calls += 1
        call = self.stub.Verify(*args, **kwargs)
        call.cancel()  # a read on it raises; the link takes that as the stream lost
        return call


def test_a_request_that_fails_every_verifier_gives_up_after_a_few_moves(two_verifiers):
    """The replica recovers (a refresh finds it serving) after every failure, but the request's text
    fails it again: the session moves at most MAX_MIGRATIONS_PER_REPLICA times per replica, then
    the client gets UNAVAILABLE, instead of cycling through the pool until its deadline."""
    from gateway.migration import MAX_MIGRATIONS_PER_REPLICA

    async def go():
        pool = ReplicaPool("verifier", verifier_pb2_grpc.VerifierStub, DEFAULT_MAX_MESSAGE_BYTES)
        pool.set_addresses([two_verifiers[0].address])
        await pool.refresh()
        replica = pool.replicas[0]
        replica.stub = failing = _FailingVerifyStub(replica.stub)

        async def refresh_often():
            while True:
                await asyncio.sleep(0.05)
                await pool.refresh()

        refresher = asyncio.ensure_future(refresh_often())
        verifier = MigratingVerifier(pool, replica, "crash-loop", PROMPT_IDS, SamplingParams(max_new_tokens=8),
                                     lambda: None, request_id="req-crash", wait_s=lambda: 30.0)
        try:
            with pytest.raises(VerifierUnavailable) as info:
                await asyncio.wait_for(verifier.prefill(), 20)
        finally:
            refresher.cancel()
            await verifier.close()
            await replica.channel.close()
        return verifier, failing, info.value

    verifier, failing, error = asyncio.run(go())
    assert verifier.migrations == MAX_MIGRATIONS_PER_REPLICA
    assert failing.calls == MAX_MIGRATIONS_PER_REPLICA + 1
    assert f"after {MAX_MIGRATIONS_PER_REPLICA} moves" in str(error)


def test_a_drafter_s_proposal_the_verifier_would_refuse_is_the_drafter_s_failure():
    """More drafts than asked for, or an id past the vocabulary: the verifier would answer the block
    INVALID_ARGUMENT, which passes on to the client as the request's own error. The gateway checks
    the proposal as it arrives instead: the drafter's stream is lost (the request goes on at k = 0)."""
    from gateway.links import StreamLost, _proposal

    assert _proposal(drafter_pb2.DraftProposal(draft_token_ids=[1, 2, 3]), 3, 100).draft_tokens == [1, 2, 3]
    with pytest.raises(StreamLost, match="3 tokens where 2 were asked for"):
        _proposal(drafter_pb2.DraftProposal(draft_token_ids=[1, 2, 3]), 2, 100)
    with pytest.raises(StreamLost, match="id 100, outside the vocabulary"):
        _proposal(drafter_pb2.DraftProposal(draft_token_ids=[5, 100]), 4, 100)


def test_peer_failures_map_to_unavailable_and_bugs_to_internal():
    class Rpc(grpc.aio.AioRpcError):
        def __init__(self, code):
            super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")

    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
                 grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
        assert status_for(Rpc(code)) == grpc.StatusCode.UNAVAILABLE, code
    for code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.INVALID_ARGUMENT):
        assert status_for(Rpc(code)) == code
    assert status_for(ConnectionResetError()) == grpc.StatusCode.UNAVAILABLE
    assert status_for(KeyError("bug")) == grpc.StatusCode.INTERNAL


def test_bad_utf8_field_names_the_field():
    request = build_request(messages=[("user", "fine"), ("user", "MARK")], stop=["ok"])
    data = request.SerializeToString().replace(b"MARK", b"\xff\xfe\xfd\xfc")
    assert bad_utf8_field(data, gateway_pb2.GenerateRequest.DESCRIPTOR) == "messages[1].content"
    data = build_request(prompt="x", stop=["a", "MARK"]).SerializeToString().replace(b"MARK", b"\xc3\x28!!")
    assert bad_utf8_field(data, gateway_pb2.GenerateRequest.DESCRIPTOR) == "sampling.stop[1]"
    assert bad_utf8_field(b"\x12\x05ab", gateway_pb2.GenerateRequest.DESCRIPTOR) is None  # truncated


# -- through a running gateway --------------------------------------------------------------------

@pytest.fixture(scope="module")
def proxied_stack(tiny_pair, noisy_draft, tmp_path_factory):
    """verifier and drafter behind resetting proxies, a gateway over the proxies (with API keys)."""
    log_dir = tmp_path_factory.mktemp("proxied")
    verifier = start_service("verifier", ["--target", str(tiny_pair[1])], log_dir)
    drafter = start_service("drafter", ["--method", "model", "--draft-model", str(noisy_draft)], log_dir)
    serving(verifier, drafter)
    proxies = {"verifier": ResettingProxy(verifier.address), "drafter": ResettingProxy(drafter.address)}
    gateway = gateway_over(tiny_pair, log_dir, [proxies["verifier"].address], [proxies["drafter"].address],
                           env={"SPECDEC_API_KEYS": API_KEY})
    serving(gateway)
    yield gateway, proxies
    for service in (gateway, verifier, drafter):
        service.stop()
    for proxy in proxies.values():
        proxy.close()


def stream_until(client, n_events: int, action, **kwargs):
    events, error, acted_at = [], None, None
    try:
        for event in client.stream(**kwargs):
            events.append(event)
            if len(events) == n_events:
                acted_at = time.monotonic()
                action()
    except grpc.RpcError as exc:
        error = (exc, time.monotonic())
    return events, error, acted_at


def test_drafter_connection_reset_mid_request_stays_exact(proxied_stack, tiny_target):
    gateway, proxies = proxied_stack
    with GatewayClient(gateway.address, timeout=120, api_key=API_KEY) as client:
        events, error, _ = stream_until(client, 3, proxies["drafter"].reset, prompt="the quick brown",
                                        max_new_tokens=200, method="model", num_draft_tokens=3,
                                        request_id="reset-drafter")
        assert error is None, error
        final = events[-1]
        assert isinstance(final, FinalEvent) and final.finish_reason in ("stop", "length")
        tokens = [t for e in events if isinstance(e, ChunkEvent) for t in e.token_ids]
        assert tokens == reference_greedy(tiny_target, final.prompt_token_ids, 200)
        assert re.search(r"drafter failed for request reset-drafter \(drafter session [0-9a-f]{32}\)", gateway.log())
        # The gateway and the drafter (reached over a new connection) still serve.
        again = client.generate(prompt="the quick brown", max_new_tokens=20, method="model", num_draft_tokens=3)
        assert again.token_ids == reference_greedy(tiny_target, final.prompt_token_ids, 20)
    traceback_free(gateway.log())


def test_verifier_connection_reset_without_replica_waits_and_completes_exactly(proxied_stack, tiny_target):
    """The only verifier's connection resets mid-stream: the request waits (--verifier-wait) until a
    refresh finds the verifier serving again, re-prefills its committed text there and completes
    token-identical to plain decoding (before: UNAVAILABLE at once)."""
    gateway, proxies = proxied_stack
    with GatewayClient(gateway.address, timeout=120, api_key=API_KEY) as client:
        events, error, acted_at = stream_until(client, 3, proxies["verifier"].reset, prompt="the",
                                               max_new_tokens=200, ignore_eos=True, method="none",
                                               request_id="reset-verifier")
        assert error is None, error
        final = events[-1]
        assert isinstance(final, FinalEvent) and final.finish_reason == "length"
        tokens = [t for e in events if isinstance(e, ChunkEvent) for t in e.token_ids]
        assert tokens == reference_greedy(tiny_target, final.prompt_token_ids, 200)
        log = gateway.log()
        assert re.search(r"verifier \S+ failed for request reset-verifier .*waiting up to 30 s", log)
        assert re.search(r"verifier \S+ failed for request reset-verifier .*re-prefilling \d+ tokens", log)
    traceback_free(gateway.log())


def test_downstream_session_ids_are_minted_not_the_request_id(proxied_stack, tiny_target):
    gateway, _ = proxied_stack
    long_id = "r" * 200  # fits the gateway's request_id limit (256), not a service's session_id limit
    request = build_request(prompt="the quick brown", max_new_tokens=12, method="model", num_draft_tokens=2,
                            request_id=long_id)
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        metadata = (("authorization", f"Bearer {API_KEY}"),)

        def run(req):
            return list(stub.Generate(req, timeout=60, metadata=metadata))

        responses = run(request)
        assert all(r.request_id == long_id for r in responses)
        # Two requests with the same id at once: separate sessions, each exact.
        same = build_request(prompt="the quick brown", max_new_tokens=40, method="model", num_draft_tokens=2,
                             request_id="same-id")
        results: list = [None, None]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(same))) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    expected = reference_greedy(tiny_target, list(responses[-1].prompt_token_ids), 40)
    for result in results:
        assert [t for r in result[:-1] for t in r.token_ids] == expected
    sessions = re.findall(r"request same-id: verifier session (\S+) on \S+, drafter session (\S+)", gateway.log())
    assert len(sessions) == 2
    ids = [s for pair in sessions for s in pair if s != "none"]  # (none: no drafter ready just then)
    assert len(ids) >= 2 and len(set(ids)) == len(ids) and all(re.fullmatch(r"[0-9a-f]{32}", s) for s in ids), ids


BIG_SENDER = r"""
import os, sys, threading, grpc
sys.path.insert(0, sys.argv[2])
from specdec.client import build_request
from specdec.rpc.server import channel_options
os.nice(19)  # the load under test is the gateway's, not this process's competing for the CPUs
channel = grpc.insecure_channel(sys.argv[1], options=channel_options())
generate = channel.unary_stream("/specdec.v1.Gateway/Generate", request_serializer=None,
                                response_deserializer=None)
metadata = (("authorization", "Bearer " + sys.argv[3]),)
payloads = [build_request(prompt="a b " * 1_000_000, max_new_tokens=8).SerializeToString(),
            build_request(messages=[("user", "c d " * 500_000), ("user", "e f " * 499_000)],
                          max_new_tokens=8).SerializeToString()]
def one(data, results):
    try:
        list(generate(data, timeout=60, metadata=metadata))
        results.append("OK")
    except grpc.RpcError as exc:
        results.append(f"{exc.code().name} {exc.details()}")
print("ready", flush=True)
while sys.stdin.readline().strip() == "go":
    results = []
    threads = [threading.Thread(target=one, args=(payloads[i % 2], results)) for i in range(3)]
    for t in threads: t.start()
    for t in threads: t.join()
    print(" | ".join(results), flush=True)
"""


def max_gap(client, go=None, done=None, window: int = 150) -> float:
    """The longest wait between chunks of one plain-decoding stream, from its 20th chunk on, over
    ``window`` chunks (and, with ``done``, until it is set)."""
    stamps = []
    for event in client.stream(prompt="the", max_new_tokens=2000, ignore_eos=True, method="none"):
        stamps.append(time.perf_counter())
        if len(stamps) == 20 and go is not None:
            go()
        if len(stamps) >= 20 + window and (done is None or done.is_set()):
            break
    gaps = [b - a for a, b in zip(stamps[20:], stamps[21:])]
    return max(gaps)


def test_huge_prompts_are_refused_before_tokenizing_without_stalling_other_streams(proxied_stack):
    """Three 4 MB prompts at once, while a stream decodes: its longest wait between chunks grows by
    less than 100 ms (before: seconds, the event loop tokenizing them). Measured up to three times
    on this shared machine: a real stall fails every time, a scheduling hiccup rarely does twice."""
    gateway, _ = proxied_stack
    sender = subprocess.Popen([sys.executable, "-c", BIG_SENDER, gateway.address, str(ROOT), API_KEY],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    measured = []
    try:
        assert sender.stdout.readline().strip() == "ready"
        with GatewayClient(gateway.address, timeout=120, api_key=API_KEY) as client:
            for _ in range(3):
                baseline = max_gap(client)
                done = threading.Event()
                answers: list[str] = []

                def go():
                    sender.stdin.write("go\n")
                    sender.stdin.flush()
                    threading.Thread(target=lambda: (answers.append(sender.stdout.readline().strip()), done.set()),
                                     daemon=True).start()

                loaded = max_gap(client, go, done)
                assert done.wait(60)
                refusals = answers[0].split(" | ")
                assert len(refusals) == 3, answers
                for refusal in refusals:
                    assert re.match(r"INVALID_ARGUMENT (prompt|messages): \d+ characters", refusal), refusal
                measured.append((baseline, loaded))
                if loaded - baseline < 0.1:
                    break
        sender.stdin.close()
        assert sender.wait(60) == 0
    finally:
        if sender.poll() is None:
            sender.kill()
    assert min(loaded - baseline for baseline, loaded in measured) < 0.1, measured
    traceback_free(gateway.log())


def raw_generate(address: str, data: bytes, metadata=None):
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream("/specdec.v1.Gateway/Generate", request_serializer=None,
                                    response_deserializer=gateway_pb2.GenerateResponse.FromString)
        return list(call(data, timeout=30, metadata=metadata))


@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt="MARK"), "prompt"),
    (dict(messages=[("user", "hello"), ("user", "MARK")]), "messages[1].content"),
    (dict(prompt="x", stop=["MARK"]), "sampling.stop[0]"),
    (dict(prompt="x", request_id="MARK"), "request_id"),
])
def test_invalid_utf8_is_invalid_argument_and_a_missing_key_unauthenticated(proxied_stack, kwargs, field):
    gateway, _ = proxied_stack
    data = build_request(max_new_tokens=4, **kwargs).SerializeToString()
    assert data.count(b"MARK") == 1
    data = data.replace(b"MARK", b"\xff\xfeAB")
    with pytest.raises(grpc.RpcError) as info:
        raw_generate(gateway.address, data, (("authorization", f"Bearer {API_KEY}"),))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert info.value.details().startswith(f"{field}: not valid UTF-8"), info.value.details()
    for metadata in (None, (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as info:
            raw_generate(gateway.address, data, metadata)  # the same bad bytes: the key decides first
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
        with pytest.raises(grpc.RpcError) as info:
            raw_generate(gateway.address, build_request(prompt="hi", max_new_tokens=2).SerializeToString(), metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    with pytest.raises(grpc.RpcError) as info:
        raw_generate(gateway.address, b"\x12\x40abc", (("authorization", f"Bearer {API_KEY}"),))  # truncated
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("request: does not parse")
    traceback_free(gateway.log())
