"""The ``eagle`` draft method: the EAGLE head behind the one ``Drafter`` interface.

A session holds the committed tokens and the target's features for committed positions (streamed
by the verifier with every verdict, passed on by the gateway: ``add_features``), and drafts with a
``HeadSession``. Greedy drafts report one-hot q; sampled drafts report the exact q they were drawn
from (``drafters.choose_draft``: the processed, top-K-truncated head distribution, position-keyed
draws), so acceptance stays exact whatever the head's quality.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.drafters import choose_draft
from specdec.drafting import DraftSession, Drafter
from specdec.eagle.drafting import HeadSession
from specdec.eagle.head import EagleHead, TargetTensors
from specdec.lm import LoadedModel
from specdec.models import resolve_model_path
from specdec.wire_types import DraftProposal, FieldError, SamplingParams
from specdec.target_features import WIRE_DTYPE, TargetFeatures


# The LM head's ids while drafting: the most frequent 4096 of the 16384 trained. A smaller head halves the
# step's cost for almost no acceptance (docs/sweeps/2026-12-05-eagle-through-the-services.md, "Cost of a
# head step").
DRAFTING_HEAD_TOKENS = 4096


class FeatureHistory:
    """The target's features for positions first .. length - 1, in a buffer that grows by doubling
    (a round appends its few rows; nothing is copied per round beyond them).

    ``first`` is 0 unless the features began later: a long prompt's are windowed (``TargetSession``),
    and a relay keeps only the newest features that fit one message while a session drafts nothing
    (``gateway.feature_relay.FeatureRelay``). Features that start past ``length`` (a jump forward: the
    relay dropped those between) or before ``first`` (a migrated verifier's windowed prefill resends
    from earlier) start the history afresh there; the head then drafts from them on
    (``HeadSession``), which changes drafts only, never the output."""

    def __init__(self, width: int) -> None:
        self.width = width
        self._rows = torch.empty((0, width), dtype=WIRE_DTYPE)
        self.first = 0
        self.length = 0

    def write(self, features: TargetFeatures) -> None:
        """Store ``features``; positions already held are overwritten (a migrated verifier resends)."""
        if features.values.shape[1] != self.width:
            raise FieldError("target_features.hidden_size", f"{features.values.shape[1]}, this drafter's head "
                             f"reads {self.width}")
        if self.length == self.first or not self.first <= features.start <= self.length:
            self.first = self.length = features.start  # the first features, or a fresh start (see above)
        end = features.end
        if end - self.first > self._rows.shape[0]:
            grown = torch.empty((max(end - self.first, 2 * self._rows.shape[0], 256), self.width), dtype=WIRE_DTYPE)
            grown[: self.length - self.first] = self._rows[: self.length - self.first]
            self._rows = grown
        self._rows[features.start - self.first: end - self.first] = features.values.to(WIRE_DTYPE)
        self.length = max(self.length, end)

    def view(self) -> torch.Tensor:
        return self._rows[: self.length - self.first]


class EagleDraftSession(DraftSession):
    reads_features = True

    def __init__(self, head: EagleHead, prompt_ids: list[int], params: SamplingParams, vocab_size: int) -> None:
        super().__init__(prompt_ids, params)
        self.head_session = HeadSession(head)
        self.features = FeatureHistory(head.config.hidden_size)
        self.vocab_size = vocab_size
        self.drafted_through = 0  # tokens[:drafted_through] were committed at the last proposal

    def add_features(self, features: TargetFeatures) -> None:
        self.features.write(features)

    def propose(self, num_draft_tokens: int) -> DraftProposal:
        n = len(self.tokens) - 1
        if num_draft_tokens <= 0 or n < 1 or self.features.length <= self.features.first:
            return DraftProposal()  # nothing to draft from yet (no verdict's features)
        if self.features.length > n:
            raise FieldError("target_features", f"features up to position {self.features.length - 1} for "
                             f"{len(self.tokens)} committed tokens (at most position {n - 1})")
        choose, probs = None, None
        if not self.params.greedy:
            probs = []
            base = len(self.tokens)

            def choose(full_logits: torch.Tensor) -> int:
                token, q = choose_draft(full_logits[None], self.params, self.vocab_size, base + len(probs))
                probs.append(q)
                return token

        drafted = self.head_session.draft(self.tokens, self.features.view(), num_draft_tokens,
                                          features_start=self.features.first, choose=choose,
                                          unchanged=self.drafted_through)
        self.drafted_through = len(self.tokens) - self.assumed
        return DraftProposal(drafted.token_ids, probs)

    def close(self) -> None:
        self.head_session.close()


class EagleDrafter(Drafter):
    """Feature-level drafting with a trained EAGLE head (``specdec train-draft eagle-train``)."""

    name = "eagle"
    supports_draft_ahead = False  # a block ahead would need features the verifier has not computed yet

    def __init__(self, head: EagleHead, vocab_size: int, head_name: str = "eagle") -> None:
        self.head = head.for_drafting()
        self.vocab_size = vocab_size
        self.feature_size = head.config.hidden_size
        self.head_name = head_name  # what GetInfo reports as the draft model

    @classmethod
    def load(cls, head_dir: str | Path, target: LoadedModel | TargetTensors,
             max_head_tokens: int | None = DRAFTING_HEAD_TOKENS) -> EagleDrafter:
        """The head in ``head_dir`` over ``target``'s embedding and LM head rows (a loaded target, or
        only those tensors: ``target_rows.read_target``), its LM head cut to the ``max_head_tokens``
        most frequent ids (None: all it was trained with)."""
        tensors = TargetTensors.of(target)
        head = EagleHead.load(resolve_model_path(str(head_dir)), tensors, max_head_tokens)
        return cls(head, tensors.vocab_size, f"eagle:{Path(str(head_dir)).name}")

    def start(self, prompt_ids: list[int], params: SamplingParams) -> DraftSession:
        return EagleDraftSession(self.head, prompt_ids, params, self.vocab_size)
