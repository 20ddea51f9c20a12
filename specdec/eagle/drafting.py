"""Incremental drafting with the EAGLE head: its KV cache and one sequence's session.

The drafter's side of feature-level drafting: it holds the committed tokens x_0..x_n and the
target's features f_0..f_{F-1} (streamed by the verifier with each verdict) and asks for k drafts.
Positions the target has features for are fed with them; past the last one the head feeds its own
output (EAGLE). Greedy drafts are the head's argmax; a caller that samples passes ``choose`` and
gets the head's exact full-width logits to sample from (and to report as q).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.eagle.head import EagleHead, attention
from specdec.kv import common_prefix_length


class HeadCache:
    """The head layer's keys/values for one sequence, [1, kvh, length, d] views of buffers that grow
    by doubling; ``crop`` only moves the length. Slot j holds position j + 1 (position 0 has no
    previous feature and is never fed)."""

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        if self._k is None or end > self._k.shape[2]:
            capacity = max(end, 64, 0 if self._k is None else 2 * self._k.shape[2])
            grown_k = k.new_empty((*k.shape[:2], capacity, k.shape[3]))
            grown_v = v.new_empty((*v.shape[:2], capacity, v.shape[3]))
            if self.length:
                grown_k[:, :, : self.length] = self._k[:, :, : self.length]
                grown_v[:, :, : self.length] = self._v[:, :, : self.length]
            self._k, self._v = grown_k, grown_v
        self._k[:, :, self.length: end] = k
        self._v[:, :, self.length: end] = v
        self.length = end
        return self._k[:, :, :end], self._v[:, :, :end]

    def crop(self, length: int) -> None:
        self.length = max(0, min(self.length, length))


@dataclass
class Drafted:
    token_ids: list[int]
    features: torch.Tensor  # [k, H]: the head's output g that proposed each draft token


class HeadSession:
    """Incremental drafting for one sequence with the head's KV cache.

    Invariant between calls: the cache holds positions base+1..m, position s fed with (x_s, the
    target's f_{s-1}), and ``tokens`` == x_0..x_m. A call rolls back to the prefix its tokens share,
    feeds the newly settled positions in one pass, drafts (its own features past the target's), then
    crops back to the settled positions: drafted positions are recomputed from the target's features
    later. ``base`` is 0 unless the target's features began later (a long prompt's are windowed, see
    ``TargetSession``) or start afresh later (a relay's window after rounds without drafts, see
    ``FeatureHistory``): the head then attends from there on only, which changes its drafts, never the output.
    """

    def __init__(self, head: EagleHead) -> None:
        self.head = head
        self.cache = HeadCache()
        self.tokens: list[int] = []
        self.base = 0

    def step(self, token_ids: list[int], features: torch.Tensor) -> torch.Tensor:
        """Feed positions m+1..m+N (tokens ``token_ids``, previous features ``features`` [N, H]) after
        the cache; return g [N, H]."""
        head = self.head
        start = self.base + self.cache.length + 1
        ids = torch.tensor([token_ids], dtype=torch.long, device=head.embed_weight.device)
        positions = torch.arange(start, start + len(token_ids), device=ids.device)
        cos, sin = head.rope(positions)

        def attend(q, k, v):
            keys, values = self.cache.append(k, v)
            past = keys.shape[2] - q.shape[2]
            mask = torch.arange(keys.shape[2], device=q.device)[None, :] <= (past + torch.arange(q.shape[2], device=q.device))[:, None]
            return attention(q, keys, values, mask)

        return head.layer(head.fuse(ids, features[None]), cos, sin, attend)[0]

    @torch.inference_mode()
    def draft(self, tokens: list[int], features: torch.Tensor, k: int, features_start: int = 0,
              choose: Callable[[torch.Tensor], int] | None = None, unchanged: int = 0) -> Drafted:
        """Draft ``k`` tokens after the committed ``tokens`` (x_0..x_n) given the target's features
        ``features`` [F, H] for positions ``features_start``..``features_start + F - 1``.

        Greedy by default; ``choose(full_logits) -> token id`` picks each draft otherwise (a sampler
        must return the q it drew from itself: the logits it was given are the head's exact ones).
        ``unchanged``: the caller promises ``tokens[:unchanged]`` equal the last call's (committed
        text never changes), so only the rest is compared: a round's work does not grow with the context."""
        n = len(tokens) - 1
        known = features_start + len(features)  # the target's features cover positions < known
        settle = min(n, known)
        if settle < 1:
            raise ValueError("drafting needs one committed token after the first and the target's feature before it")
        same = min(unchanged, len(self.tokens), len(tokens))
        same += common_prefix_length(self.tokens[same:], tokens[same:])
        keep = min(max(same - 1, 0), self.base + self.cache.length, settle - 1)
        if keep < max(features_start, self.base):  # no features from keep on, or the cache starts later
            if features_start > settle - 1:
                raise ValueError(f"positions {features_start + 1}..{settle} lack the target's feature before them")
            self.cache, self.base, keep = HeadCache(), features_start, features_start
        self.cache.crop(keep - self.base)
        dtype = self.head.fc.weight.dtype
        g = self.step(tokens[keep + 1: settle + 1], features[keep - features_start: settle - features_start].to(dtype))[-1]
        cut = min(keep + 1, same)  # self.tokens[:same] already equal tokens[:same]
        del self.tokens[cut:]
        self.tokens.extend(tokens[cut: settle + 1])
        for s in range(settle + 1, n + 1):  # committed tokens the target has no features for yet
            g = self.step([tokens[s]], g[None])[-1]
        drafts, chain = [], []
        for j in range(k):
            chain.append(g)
            if choose is None:
                token = int(self.head.greedy_tokens(g))
            else:
                token = int(choose(self.head.full_logits(g)))
            drafts.append(token)
            if j < k - 1:
                g = self.step([token], g[None])[-1]
        self.cache.crop(settle - self.base)
        return Drafted(drafts, torch.stack(chain) if chain else features.new_zeros((0, features.shape[-1])))

    def close(self) -> None:
        self.cache = HeadCache()
        self.tokens = []
        self.base = 0
