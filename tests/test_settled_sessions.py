"""A request that settles on plain decoding closes its drafter session (issue #46): the drafter holds
no state for it from then on, and should the request draft again, a new session opens on everything
the old one had been told, so it drafts what the old one would have, and the output stays the
target's."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.links import RemoteDrafter
from specdec.completion import CompletionBuilder
from specdec.engine import GenerationResult, LocalVerifier, generate
from specdec.policy import DraftLengthPolicy, RoundObservation
from specdec.wire_types import SamplingParams
from specdec.v1 import drafter_pb2_grpc
from specdec.verification import TargetSession
from tests.harness import start_service
from tests.test_services import active_sessions, reference_greedy
from tests.tiny_models import build_noisy_copy

PROMPT_IDS = [5, 17, 42, 9, 77, 3]
NEW_TOKENS = 40
# (k, settled after choosing it) per round: drafting, then plain rounds settled from the fifth, then
# drafting again (the session reopens), then plain decoding to the end.
SCRIPT = [(3, False)] * 3 + [(0, False)] + [(0, True)] * 4 + [(2, False)] * 4


class ScriptedPolicy(DraftLengthPolicy):
    """The draft lengths and settled flags of ``SCRIPT`` (then k = 0), so that the loop's handling of
    a settled session is what is tested (the adaptive policy's rule for settling is tested in
    tests/test_policy.py)."""

    def __init__(self, settles: bool) -> None:
        self.settles = settles
        self.round = 0
        self.closed_at: list[int] = []

    def choose(self, max_k: int) -> int:
        self.round += 1
        return min(SCRIPT[self.round - 1][0] if self.round <= len(SCRIPT) else 0, max_k)

    def observe(self, outcome: RoundObservation) -> None:
        pass

    @property
    def settled(self) -> bool:
        return self.settles and self.round <= len(SCRIPT) and SCRIPT[self.round - 1][1]

    def drafter_closed(self) -> None:
        self.closed_at.append(self.round)


class RecordingDrafter(RemoteDrafter):
    """The link, with each proposal's draft tokens kept."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.proposals: list[list[int]] = []

    async def propose(self, committed: list[int], num_draft_tokens: int, ahead_tokens: int = 0):
        proposal = await super().propose(committed, num_draft_tokens, ahead_tokens)
        self.proposals.append(list(proposal.draft_tokens))
        return proposal


@pytest.fixture(scope="module")
def drafter_service(tiny_pair, tmp_path_factory):
    draft = build_noisy_copy(tmp_path_factory.mktemp("noisy") / "draft", tiny_pair[1], noise_std=0.01)
    service = start_service("drafter", ["--method", "model", "--draft-model", str(draft)],
                            tmp_path_factory.mktemp("drafter"))
    service.wait_serving()
    yield service
    service.stop()


def _run(drafter_service, tiny_target, settles: bool):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    open_by_round: list[tuple[bool, int]] = []

    async def go():
        async with grpc.aio.insecure_channel(drafter_service.address) as channel:
            link = RecordingDrafter(drafter_pb2_grpc.DrafterStub(channel), f"settled-{settles}", PROMPT_IDS,
                                    params, lambda: 60.0)
            policy = ScriptedPolicy(settles)
            session = TargetSession(tiny_target, PROMPT_IDS, params)

            def on_round(record) -> None:
                open_by_round.append((link.started, record.drafted))

            result = None
            try:
                completion = CompletionBuilder(tiny_target.tokenizer, params, tiny_target.eos_token_ids)
                async for event in generate(prompt_tokens=len(PROMPT_IDS), completion=completion,
                                            verifier=LocalVerifier(session), drafter=link, policy=policy,
                                            draft_method="model", on_round=on_round):
                    if isinstance(event, GenerationResult):
                        result = event
            finally:
                session.close()
                await link.close()
            return result, link, policy

    result, link, policy = asyncio.run(go())
    return result, link, policy, open_by_round


def test_a_settled_request_closes_its_drafter_session_and_reopens_it_on_its_whole_context(
        drafter_service, tiny_target):
    expected = reference_greedy(tiny_target, PROMPT_IDS, NEW_TOKENS)
    kept, kept_link, _, kept_open = _run(drafter_service, tiny_target, settles=False)
    closed, closed_link, policy, closed_open = _run(drafter_service, tiny_target, settles=True)
    assert kept.token_ids == expected and closed.token_ids == expected
    assert kept.stats.drafter_closes == 0 and closed.stats.drafter_closes == 1
    assert policy.closed_at == [5]
    # Closed at the end of the fifth round, until the next proposal opened a new session.
    assert closed_open[4][0] and [started for started, _ in closed_open[5:8]] == [False] * 3
    assert closed_open[8] == (True, 2) and all(started for started, _ in kept_open)
    # The reopened session drafts exactly what the kept one drafted: it has the whole context.
    assert closed_link.proposals == kept_link.proposals and len(closed_link.proposals) == 7
    assert sum(len(p) for p in closed_link.proposals[3:]) == 8 and closed.stats.accepted_tokens > 0
    assert active_sessions(drafter_service.address, "drafter") == 0
