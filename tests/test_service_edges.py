"""Edges of the services outside the gateway's care (issue #42).

- A direct client of a verifier or a drafter that leaves ``sampling.seed`` unset gets a fresh seed
  per session (as the proto promises: "Unset = random"), not seed 0 every time; an explicit seed
  still reproduces.
- ``specdec up`` serves the drafter and the verifier on ``--drafter-port``/``--verifier-port`` and
  hands ``--idle-timeout`` and ``--grace`` to the services that take them; killed by SIGKILL, it
  takes its three services with it (the parent-death signal), freeing their ports.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from specdec.client import GatewayClient
from specdec.stack import service_pids, wait_serving
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, types_pb2, verifier_pb2, verifier_pb2_grpc
from tests.harness import free_port, start_service

PROMPT = [5, 17, 42, 9, 33]
TOKENS = 24  # sampled at temperature 1 from a vocabulary of hundreds: equal by chance is negligible


@pytest.fixture(scope="module")
def model_services(tiny_pair, tmp_path_factory):
    _, target, draft = tiny_pair
    logs = tmp_path_factory.mktemp("edges")
    services = [start_service("verifier", ["--target", str(target)], logs),
                start_service("drafter", ["--method", "model", "--draft-model", str(draft)], logs)]
    try:
        for service in services:
            service.wait_serving()
        yield {service.name: service.address for service in services}
    finally:
        for service in services:
            service.stop()


def _sampling(seed: int | None) -> types_pb2.SamplingParams:
    sampling = types_pb2.SamplingParams(max_new_tokens=TOKENS, temperature=1.0, ignore_eos=True)
    if seed is not None:
        sampling.seed = seed
    return sampling


def _verified(address: str, seed: int | None) -> list[int]:
    """TOKENS tokens of one session opened directly on the verifier: the prefill's, then one per empty block."""
    start = verifier_pb2.VerifyRequest(start=verifier_pb2.VerifyStart(prompt_token_ids=PROMPT, sampling=_sampling(seed)))
    blocks = [verifier_pb2.VerifyRequest(block=verifier_pb2.VerifyBlock(round=r)) for r in range(1, TOKENS)]
    with grpc.insecure_channel(address) as channel:
        replies = verifier_pb2_grpc.VerifierStub(channel).Verify(iter([start, *blocks]), timeout=60)
        tokens = [t for reply in replies for t in reply.token_ids]
    assert len(tokens) == TOKENS
    return tokens


def _drafted(address: str, seed: int | None) -> list[int]:
    """TOKENS draft tokens of one session opened directly on the drafter (one proposal)."""
    start = drafter_pb2.DraftRequest(start=drafter_pb2.DraftStart(prompt_token_ids=PROMPT, sampling=_sampling(seed)))
    propose = drafter_pb2.DraftRequest(propose=drafter_pb2.ProposalRequest(round=1, num_draft_tokens=TOKENS))
    with grpc.insecure_channel(address) as channel:
        replies = list(drafter_pb2_grpc.DrafterStub(channel).Draft(iter([start, propose]), timeout=60))
    tokens = [t for reply in replies if reply.WhichOneof("kind") == "proposal" for t in reply.proposal.draft_token_ids]
    assert len(tokens) == TOKENS
    return tokens


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_an_unseeded_direct_session_draws_a_seed_of_its_own(model_services, role):
    sample = _verified if role == "verifier" else _drafted
    address = model_services[role]
    assert sample(address, None) != sample(address, None)
    assert sample(address, 1234) == sample(address, 1234)


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: nothing of it runs or holds a port any more)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_the_children_of_a_supervisor_killed_by_sigkill_die_with_it(tmp_path):
    """A supervisor (its own process, as ``specdec up`` is) killed by SIGKILL: its children, each one
    started (its command exec'd, so the parent-death signal armed), get SIGTERM and exit."""
    pids_file = tmp_path / "pids.json"
    script = (
        "import json, sys\n"
        "from specdec.supervisor import ChildSpec, Supervisor\n"
        "sleeper = [sys.executable, '-c', 'import time; time.sleep(120)']\n"
        "supervisor = Supervisor([ChildSpec(name, sleeper, '', drain_order=0) for name in ('a', 'b', 'c')],\n"
        "                        log=lambda line: None)\n"
        "supervisor.start_all()\n"
        f"open({str(pids_file)!r}, 'w').write(json.dumps(supervisor.pids()))\n"
        "supervisor.run()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    pids: list[int] = []
    try:
        assert _wait(lambda: pids_file.exists() and pids_file.stat().st_size, 30)
        pids = list(json.loads(pids_file.read_text()).values())

        def execed(pid: int) -> bool:
            return b"time.sleep" in Path(f"/proc/{pid}/cmdline").read_bytes()

        assert _wait(lambda: all(execed(pid) for pid in pids), 30)
        parent.kill()
        parent.wait(10)
        assert _wait(lambda: all(_gone(pid) for pid in pids), 10), [pid for pid in pids if not _gone(pid)]
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_child_whose_supervisor_is_already_gone_never_runs_its_command(tmp_path):
    """The parent-death signal covers deaths after it is armed: a child that finds itself re-parented
    by then (here: told to expect another parent) exits instead of running unsupervised."""
    from specdec.child_init import ORPHANED_EXIT, child_command

    marker = tmp_path / "ran"
    command = child_command([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], parent=os.getppid())
    assert subprocess.run(command, timeout=30).returncode == ORPHANED_EXIT
    assert not marker.exists()
    assert subprocess.run(child_command(command[-3:], parent=os.getpid()), timeout=30).returncode == 0
    assert marker.exists()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: every child runs on it anyway")
def test_a_child_runs_on_the_cpus_it_was_given_and_every_thread_it_starts_inherits_them():
    """The affinity is set in the child (specdec.child_init, before the exec), not in a preexec_fn:
    the command and a thread it starts report the one core they were given."""
    from specdec.child_init import child_command

    given = min(os.sched_getaffinity(0))
    report = ("import os, threading; seen = []; t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)));"
              " t.start(); t.join(); print(sorted(os.sched_getaffinity(0)), sorted(seen[0]))")
    shown = subprocess.run(child_command([sys.executable, "-c", report], parent=os.getpid(), cpus=frozenset({given})),
                           capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"[{given}] [{given}]"


def _listened_on(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a restarted service binds it
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _distinct_ports() -> tuple[int, int, int, int]:
    """Gateway, drafter, verifier and HTTP ports, the drafter's and verifier's not the default +1 and +2."""
    while True:
        gateway, drafter, verifier, http = (free_port() for _ in range(4))
        if len({gateway, drafter, verifier, http}) == 4 and drafter != gateway + 1 and verifier != gateway + 2:
            return gateway, drafter, verifier, http


def test_up_serves_on_its_flags_and_its_services_die_with_it(tiny_pair, tmp_path):
    """One stack: the services on the ports asked for, with the timeouts asked for, speculating; then
    kill -9 of ``specdec up`` (no drain) and every service is gone within the grace, its port free."""
    _, target, draft = tiny_pair
    gateway, drafter, verifier, http = _distinct_ports()
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-m", "specdec.cli", "up", "--target", str(target), "--draft-model",
                           str(draft), "--drafter-nice", "0", "--port", str(gateway), "--drafter-port", str(drafter),
                           "--verifier-port", str(verifier), "--http-port", str(http), "--idle-timeout", "7",
                           "--grace", "3"], start_new_session=True, stdout=log, stderr=log)
    pids: dict[str, int] = {}
    try:
        for port in (drafter, verifier, gateway):
            wait_serving(f"127.0.0.1:{port}", up, timeout=120)
        pids = service_pids(up.pid)
        assert set(pids) == {"verifier", "drafter", "gateway"}
        for role, port in (("verifier", verifier), ("drafter", drafter), ("gateway", gateway)):
            argv = Path(f"/proc/{pids[role]}/cmdline").read_bytes().decode().split("\0")
            assert argv[argv.index("--port") + 1] == str(port)
            assert argv[argv.index("--grace") + 1] == "3.0"
            if role != "gateway":  # the gateway has no sessions to time out
                assert argv[argv.index("--idle-timeout") + 1] == "7.0"
        with GatewayClient(f"127.0.0.1:{gateway}", timeout=60) as client:
            result = client.generate(prompt="def add(a, b):", max_new_tokens=16, ignore_eos=True, num_draft_tokens=3)
        assert result.stats["draft_tokens"] > 0  # the gateway reached the drafter on its port

        up.kill()
        up.wait(10)
        deadline = time.monotonic() + 20  # the services drain (--grace 3) on the parent-death SIGTERM
        while time.monotonic() < deadline and not all(_gone(pid) for pid in pids.values()):
            time.sleep(0.2)
        assert {role: _gone(pid) for role, pid in pids.items()} == {role: True for role in pids}
        assert [port for port in (gateway, drafter, verifier, http) if _listened_on(port)] == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
        for pid in pids.values():  # survivors of a failed check (this test started them)
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()
