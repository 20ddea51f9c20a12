"""In-process speculative generation: the core loop with local sessions, no network."""

from __future__ import annotations

from collections.abc import AsyncIterator

from specdec.completion import Chunk, CompletionBuilder
from specdec.costs import measure_forward_curve
from specdec.drafting import Drafter
from specdec.engine import GenerationResult, LocalDrafter, LocalVerifier, generate
from specdec.lm import LoadedModel
from specdec.policy import AcceptanceMemory, DraftLengthPolicy, make_policy
from specdec.wire_types import SamplingParams, with_random_seed
from specdec.verification import TargetSession


class LocalEngine:
    """A target and an optional drafter in this process."""

    def __init__(self, target: LoadedModel, drafter: Drafter | None = None, max_draft_tokens: int = 16) -> None:
        self.target = target
        self.drafter = drafter
        self.max_draft_tokens = max_draft_tokens
        # Adaptive draft lengths start from what recent sessions of this pair learned.
        self.memory = AcceptanceMemory()
        draft_model = getattr(getattr(drafter, "lm", None), "name", "")
        self.memory_key = AcceptanceMemory.make_key(drafter.name if drafter else "none", draft_model, target.name)
        self._forward_curve: list[float] | None = None  # the target's, timed before the first adaptive session

    def forward_curve(self) -> list[float]:
        """The target's forward cost over 1..max_draft_tokens + 1 tokens, as a verifier reports it."""
        if self._forward_curve is None:
            self._forward_curve = measure_forward_curve(self.target, self.max_draft_tokens + 1, reps=3)
        return self._forward_curve

    async def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        num_draft_tokens: int = 0,
        policy: DraftLengthPolicy | None = None,
    ) -> AsyncIterator[Chunk | GenerationResult]:
        params.validate()
        params = with_random_seed(params)
        if policy is None:
            curve = self.forward_curve() if num_draft_tokens == 0 and self.drafter is not None else None
            policy = make_policy(num_draft_tokens, memory=self.memory, key=self.memory_key,
                                 max_k=self.max_draft_tokens, forward_curve=curve,
                                 drafter_estimates=self.drafter is not None and self.drafter.estimates_acceptance)
        wants_features = self.drafter is not None and self.drafter.feature_size > 0
        target_session = TargetSession(self.target, prompt_ids, params, want_features=wants_features)
        draft_session = self.drafter.start(prompt_ids, params) if self.drafter else None
        try:
            events = generate(
                prompt_tokens=len(prompt_ids),
                completion=CompletionBuilder(self.target.tokenizer, params, self.target.eos_token_ids),
                verifier=LocalVerifier(target_session),
                drafter=LocalDrafter(draft_session) if draft_session else None,
                policy=policy,
                draft_method=self.drafter.name if self.drafter else "none",
                max_context=self.target.max_positions,
                plain_runs=False,  # in process a round costs no hop: nothing for a run to save
            )
            async for event in events:
                yield event
        finally:
            policy.close()
            target_session.close()
            if draft_session is not None:
                draft_session.close()
