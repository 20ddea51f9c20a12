"""Model drafting behind the drafting interface (``specdec.drafting``, which also holds the drafters
that need no model): a small causal LM drafts k tokens per round, batched
across sessions."""

from __future__ import annotations

from specdec.drafting import Drafter, DraftSession
from specdec.kv import KVSession
from specdec.lm import LoadedModel
from specdec.ragged import ForwardRow, batched_forward
from specdec.randomness import uniform
from specdec.sampling import DRAW_TOKEN, STREAM_DRAFT, greedy_tokens, process_logits, sample_sparse, truncate_top_k
from specdec.wire_types import DraftProposal, SamplingParams, SparseDistribution


class ModelDraftSession(DraftSession):
    def __init__(self, lm: LoadedModel, prompt_ids: list[int], params: SamplingParams) -> None:
        super().__init__(prompt_ids, params)
        self.lm = lm
        self.kv = KVSession(lm)

    def prefill(self) -> None:
        self.kv.forward(self.tokens, 1, self.committed_length, on_device=True)  # its logits go unread

    def propose(self, num_draft_tokens: int) -> DraftProposal:
        return draft_together(self.lm, [(self, num_draft_tokens)])[0]

    def _draft_from(self, logits, drafts: list[int], probs: list | None) -> None:
        """Append the next draft token, chosen from the draft's ``logits`` [1, V] at position
        ``len(self.tokens) + len(drafts)``, and (sampling) the exact distribution it came from."""
        token, q = choose_draft(logits, self.params, self.lm.vocab_size, len(self.tokens) + len(drafts))
        drafts.append(token)
        if q is not None:
            probs.append(q)

    def close(self) -> None:
        self.kv.close()


def choose_draft(logits, params: SamplingParams, vocab_size: int, position: int) -> tuple[int, SparseDistribution | None]:
    """The draft token at ``position`` from a draft's ``logits`` [1, V]: greedy, the argmax (q one-hot,
    returned as None); sampling, a draw from the processed, top-K-truncated distribution, returned as
    the exact q it was drawn from (position-keyed: the same seed and position draw the same u).
    ``logits`` may stay on the draft's device: the host reads one token, or the K-entry support."""
    if params.greedy:
        return int(greedy_tokens(logits, vocab_size)[0]), None
    q = truncate_top_k(process_logits(logits, params, vocab_size)[0], params.draft_top_k)
    return sample_sparse(q, uniform(params.resolved_seed(), position, STREAM_DRAFT, DRAW_TOKEN)), q


def draft_together(lm: LoadedModel, requests: list[tuple[ModelDraftSession, int]]) -> list[DraftProposal]:
    """Draft for several sessions of ``lm`` at once: step i runs one batched forward over every session
    still short of its k. Each session's drafts are what it would draft alone."""
    drafts: list[list[int]] = [[] for _ in requests]
    probs = [None if session.params.greedy else [] for session, _ in requests]
    active = [i for i, (_, k) in enumerate(requests) if k > 0]
    while active:
        rows = [ForwardRow(session.kv, session.tokens + drafts[i], 1, session.committed_length)
                for i in active for session in (requests[i][0],)]
        for i, logits in zip(active, batched_forward(lm, rows, on_device=True)):
            requests[i][0]._draft_from(logits, drafts[i], probs[i])
        active = [i for i in active if len(drafts[i]) < requests[i][1]]
    return [DraftProposal(d, p) for d, p in zip(drafts, probs)]


class ModelDrafter(Drafter):
    """A small causal LM sharing the target's tokenizer."""

    name = "model"

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm

    def start(self, prompt_ids: list[int], params: SamplingParams) -> DraftSession:
        return ModelDraftSession(self.lm, prompt_ids, params)

    def propose_batch(self, requests: list[tuple[DraftSession, int]]) -> list[DraftProposal]:
        return draft_together(self.lm, requests)
