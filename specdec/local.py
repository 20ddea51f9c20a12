"""In-process speculative generation: the core loop with local sessions, no network."""

from __future__ import annotations

from collections.abc import AsyncIterator

from specdec.completion import Chunk, CompletionBuilder
from specdec.drafters import Drafter
from specdec.engine import GenerationResult, LocalDrafter, LocalVerifier, generate
from specdec.models import LoadedModel
from specdec.policy import DraftLengthPolicy, FixedDraftLength, HeuristicDraftLength
from specdec.sampling import SamplingParams, with_random_seed
from specdec.verification import TargetSession


def make_policy(num_draft_tokens: int) -> DraftLengthPolicy:
    """0 means adaptive."""
    return HeuristicDraftLength() if num_draft_tokens == 0 else FixedDraftLength(num_draft_tokens)


class LocalEngine:
    """A target and an optional drafter in this process."""

    def __init__(self, target: LoadedModel, drafter: Drafter | None = None) -> None:
        self.target = target
        self.drafter = drafter

    async def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        num_draft_tokens: int = 0,
        policy: DraftLengthPolicy | None = None,
    ) -> AsyncIterator[Chunk | GenerationResult]:
        params.validate()
        params = with_random_seed(params)
        target_session = TargetSession(self.target, prompt_ids, params)
        draft_session = self.drafter.start(prompt_ids, params) if self.drafter else None
        try:
            events = generate(
                prompt_tokens=len(prompt_ids),
                completion=CompletionBuilder(self.target.tokenizer, params, self.target.eos_token_ids),
                verifier=LocalVerifier(target_session),
                drafter=LocalDrafter(draft_session) if draft_session else None,
                policy=policy or make_policy(num_draft_tokens),
                draft_method=self.drafter.name if self.drafter else "none",
                max_context=self.target.max_positions,
            )
            async for event in events:
                yield event
        finally:
            target_session.close()
            if draft_session is not None:
                draft_session.close()
