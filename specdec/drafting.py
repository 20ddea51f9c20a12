"""The drafting interface (``Drafter`` shared across requests, ``DraftSession`` per generation,
after transformers' ``CandidateGenerator``) and the drafters that need no model: prompt lookup
(n-gram) and scripted proposals (tests). No torch here: the gateway drafts n-grams itself.

A session learns committed tokens through ``extend()`` and proposes k draft tokens with their exact
draft distributions through ``propose()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from specdec.wire_types import DraftProposal, FieldError, SamplingParams, VerdictFeatures


class DraftSession(ABC):
    """Per-generation drafting state. ``tokens`` is the committed sequence (prompt + output).

    A feature-level session (``reads_features``) also gets the target's features (``add_features``)
    for the committed positions before each ``propose``."""

    reads_features = False

    def __init__(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.tokens: list[int] = list(prompt_ids)
        self.params = params
        self.assumed = 0  # trailing tokens of ``tokens`` that draft-ahead assumes, not yet committed

    @property
    def committed_length(self) -> int:
        return len(self.tokens) - self.assumed

    def extend(self, committed: list[int]) -> None:
        """Tokens the verifier committed since the last call (accepted drafts + recovered/bonus)."""
        self.tokens.extend(int(t) for t in committed)

    def add_features(self, features: VerdictFeatures) -> None:
        """The target's features at some committed positions (``reads_features`` sessions only)."""
        raise FieldError("target_features", f"the {type(self).__name__} drafter does not read target features")

    @abstractmethod
    def propose(self, num_draft_tokens: int) -> DraftProposal:
        """Up to ``num_draft_tokens`` draft tokens continuing ``self.tokens``."""

    def propose_ahead(self, in_flight: list[int], num_draft_tokens: int) -> tuple[list[int], DraftProposal] | None:
        """Draft-ahead: the block for the round after ``in_flight`` (drafts now being verified).

        Assumes the verifier accepts all of ``in_flight`` and commits this drafter's own next token
        (its guess for the bonus token). Returns ``(assumed, proposal)`` with ``assumed`` =
        ``in_flight`` + [guess], or None when there is nothing to guess. The committed sequence is
        unchanged. If the verifier then commits exactly ``assumed``, ``proposal`` is what ``propose``
        would return after ``extend(assumed)`` (same context, same position-keyed draws), so using it
        keeps the output exact; otherwise it is discarded.
        """
        committed = self.tokens
        self.tokens = committed + [int(t) for t in in_flight]
        self.assumed = len(in_flight)
        try:
            block = self.propose(num_draft_tokens + 1)
        finally:
            self.tokens, self.assumed = committed, 0
        if len(block) == 0:
            return None
        rest = DraftProposal(block.draft_tokens[1:], None if block.draft_probs is None else block.draft_probs[1:])
        return [int(t) for t in in_flight] + [int(block.draft_tokens[0])], rest

    def finish(self, committed: list[int]) -> None:
        """The generation ended; ``committed``: its tokens since the last ``extend``. Only a drafter
        that learns from finished requests (suffix) needs them."""

    def prefill(self) -> None:
        """Optionally process the prompt ahead of the first proposal (overlaps the target's prefill)."""

    def close(self) -> None:
        """Free per-session resources (KV cache)."""


class Drafter(ABC):
    """A draft method. ``name`` is what stats and traces report."""

    name: str = "drafter"
    feature_size: int = 0  # > 0: sessions read the target's features of this width (EAGLE)
    supports_draft_ahead: bool = True  # sessions implement ``propose_ahead``
    estimates_acceptance: bool = False  # proposals carry ``acceptance_estimates`` (the loop trims to the best prefix)

    @abstractmethod
    def start(self, prompt_ids: list[int], params: SamplingParams) -> DraftSession:
        """Open a drafting session for one generation."""

    def start_in_scope(self, prompt_ids: list[int], params: SamplingParams, scope: str) -> DraftSession:
        """``start`` for a request of ``scope`` (its tenant and cache scope). A drafter that remembers
        across requests (suffix) keeps each scope's text to that scope; the others ignore it."""
        return self.start(prompt_ids, params)

    def propose_batch(self, requests: list[tuple[DraftSession, int]]) -> list[DraftProposal]:
        """``session.propose(k)`` for several sessions of this drafter; model drafters run the
        sessions' draft steps as batched forward passes. Results are the same as one by one."""
        return [session.propose(k) for session, k in requests]


class NgramDraftSession(DraftSession):
    def __init__(self, prompt_ids, params, max_ngram: int, min_ngram: int) -> None:
        super().__init__(prompt_ids, params)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, num_draft_tokens: int) -> DraftProposal:
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            # Latest earlier occurrence first: recent text predicts the continuation best.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + num_draft_tokens]
                    if follow:
                        return DraftProposal(list(follow), None)
        return DraftProposal()


class NgramDrafter(Drafter):
    """Prompt lookup: match the last n tokens earlier in prompt + output, propose what followed.

    Deterministic, so q is one-hot on each draft token.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def start(self, prompt_ids: list[int], params: SamplingParams) -> DraftSession:
        return NgramDraftSession(prompt_ids, params, self.max_ngram, self.min_ngram)


ProposeFn = Callable[[list[int], int, SamplingParams], DraftProposal]


class ScriptedDraftSession(DraftSession):
    def __init__(self, prompt_ids, params, script: ProposeFn) -> None:
        super().__init__(prompt_ids, params)
        self.script = script

    def propose(self, num_draft_tokens: int) -> DraftProposal:
        proposal = self.script(list(self.tokens), num_draft_tokens, self.params)
        if len(proposal) > num_draft_tokens:
            raise ValueError("scripted drafter proposed more tokens than asked")
        return proposal


class ScriptedDrafter(Drafter):
    """Tests: proposals come from a function of (committed tokens, k, params)."""

    name = "scripted"

    def __init__(self, script: ProposeFn) -> None:
        self.script = script

    def start(self, prompt_ids: list[int], params: SamplingParams) -> DraftSession:
        return ScriptedDraftSession(prompt_ids, params, self.script)
