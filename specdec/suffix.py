"""Suffix drafting (after SuffixDecoding, Oliaro et al. 2024): draft what followed the longest
match of the context's suffix, in the request's own prompt and output and in what the target
wrote earlier for the same tenant.

- ``SuffixIndex``: token documents and, for every position, which documents continue after the
  ``anchor`` tokens ending there. A lookup takes the context's last ``anchor`` tokens, extends each
  of the most recent ``max_candidates`` occurrences backwards (the match length, at most
  ``max_depth``) and keeps the longest; its cost is O(candidates x match length), never O(context).
- ``SuffixCache``: one index per scope (tenant, cache scope) under one token budget, least recently
  used documents evicted first. A scope only ever reads its own documents: acceptance is visible to
  the client (the stats, the chunk sizes, the latency), so a draft made of another tenant's text
  would let a client test guesses of it token by token (docs/suffix.md).
- ``SuffixDrafter`` / ``SuffixDraftSession``: the ``Drafter`` over both. Candidates are scored as
  SuffixDecoding scores them: at each step the continuation most frequent among the matched
  occurrences, p = its share of them; a draft ends where the running product of p falls below
  ``min_token_prob`` or at ``spec_factor`` x match length (a long match earns a long draft).

Deterministic: q is one-hot on each draft token (``DraftProposal.draft_probs`` None), so exact
acceptance keeps the output the target's under any sampling.
"""

from __future__ import annotations

import math
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.drafting import Drafter, DraftSession
from specdec.wire_types import DraftProposal, SamplingParams

# An occurrence is one int: the document's serial above POSITION_BITS, the position below.
POSITION_BITS = 24
POSITION_MASK = (1 << POSITION_BITS) - 1
TOKEN_BITS = 20  # token ids below 2**20 (vocabularies are ~32k-256k): an anchor's key is one int
MAX_CACHE_SCOPE_LENGTH = 128  # characters of a client's speculation.cache_scope
MAX_SCOPE_KEY_BYTES = 1024  # a composed scope (cache_scope_key) as a drafter service takes it
PROMPT_LEAD_IN = 16  # prompt tokens kept before a cached output, so its first tokens can be matched


def anchor_key(tokens: Sequence[int], end: int, anchor: int) -> int:
    """The ``anchor`` tokens ending before ``end`` as one int."""
    key = 0
    for t in tokens[end - anchor:end]:
        key = (key << TOKEN_BITS) | t
    return key


@dataclass(frozen=True)
class SuffixMatch:
    """What a lookup found: the match length and the occurrences that reach it, as (document,
    position where its continuation starts, serial), most recent first."""

    length: int
    occurrences: list[tuple[array, int, int]]


@dataclass(frozen=True)
class SuffixDraft:
    """A candidate: tokens, the estimated probability that the first i + 1 of them are all accepted
    (non-increasing), the match it continues, and the document it came from (for LRU)."""

    tokens: list[int]
    cumulative_probs: list[float]
    match_length: int
    serial: int | None

    @property
    def score(self) -> float:
        """Expected accepted tokens under the estimate (SuffixDecoding's candidate score)."""
        return sum(self.cumulative_probs)


NO_DRAFT = SuffixDraft([], [], 0, None)


class SuffixIndex:
    """Documents (``array('i')`` of token ids) and where each anchor occurs in them."""

    def __init__(self, anchor: int = 2) -> None:
        if anchor < 1:
            raise ValueError("anchor must be >= 1")
        self.anchor = anchor
        self.documents: dict[int, array] = {}
        # anchor key -> {occurrence: None}, oldest first (a dict: O(1) removal, ordered iteration)
        self.occurrences: dict[int, dict[int, None]] = {}
        self.num_tokens = 0

    def add(self, serial: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to document ``serial`` (a new one if unknown), indexing each new position."""
        doc = self.documents.get(serial)
        if doc is None:
            doc = self.documents[serial] = array("i")
        anchor, base = self.anchor, serial << POSITION_BITS
        for t in tokens:
            doc.append(t)
            end = len(doc)
            if end > POSITION_MASK:
                raise ValueError("document too long for the suffix index")
            if end >= anchor:
                key = anchor_key(doc, end, anchor)
                found = self.occurrences.get(key)
                if found is None:
                    self.occurrences[key] = {base | end: None}
                else:
                    found[base | end] = None
        self.num_tokens += len(tokens)

    def remove(self, serial: int) -> int:
        """Forget document ``serial``; returns how many tokens it held."""
        doc = self.documents.pop(serial, None)
        if doc is None:
            return 0
        anchor, base = self.anchor, serial << POSITION_BITS
        for end in range(anchor, len(doc) + 1):
            key = anchor_key(doc, end, anchor)
            found = self.occurrences[key]
            del found[base | end]
            if not found:
                del self.occurrences[key]
        self.num_tokens -= len(doc)
        return len(doc)

    def longest_match(self, context: Sequence[int], max_depth: int, max_candidates: int,
                      exclude: int | None = None) -> SuffixMatch:
        """The longest suffix of ``context`` (up to ``max_depth`` tokens) that occurs here with a
        continuation, among the ``max_candidates`` most recent occurrences of its last ``anchor`` tokens."""
        n, anchor = len(context), self.anchor
        if n < anchor:
            return SuffixMatch(0, [])
        found = self.occurrences.get(anchor_key(context, n, anchor))
        if not found:
            return SuffixMatch(0, [])
        best, best_occurrences, seen = 0, [], 0
        for occurrence in reversed(found):
            serial, end = occurrence >> POSITION_BITS, occurrence & POSITION_MASK
            if serial == exclude:
                continue
            doc = self.documents[serial]
            if end >= len(doc):  # the document's last position: nothing follows yet
                continue
            length, limit = anchor, min(max_depth, end, n)
            while length < limit and doc[end - length - 1] == context[n - length - 1]:
                length += 1
            if length > best:
                best, best_occurrences = length, [(doc, end, serial)]
            elif length == best:
                best_occurrences.append((doc, end, serial))
            seen += 1
            if seen >= max_candidates:
                break
        return SuffixMatch(best, best_occurrences)

    def draft(self, context: Sequence[int], config: SuffixConfig, max_tokens: int,
              exclude: int | None = None) -> SuffixDraft:
        """The candidate continuing the longest match of ``context`` here (``NO_DRAFT`` if none)."""
        match = self.longest_match(context, config.max_depth, config.max_candidates, exclude)
        if not match.length:
            return NO_DRAFT
        return continue_match(match, draft_limit(config, match.length, max_tokens), config.min_token_prob)


def continue_match(match: SuffixMatch, max_tokens: int, min_token_prob: float) -> SuffixDraft:
    """Follow the most frequent continuation of ``match``'s occurrences (ties: the most recent),
    while the running product of its shares stays at or above ``min_token_prob``."""
    tokens: list[int] = []
    cumulative: list[float] = []
    alive = match.occurrences
    p = 1.0
    for step in range(max_tokens):
        counts: dict[int, int] = {}
        for doc, end, _ in alive:
            if end + step < len(doc):
                t = doc[end + step]
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)  # the first maximum: the most recent occurrence's
        p *= counts[token] / sum(counts.values())
        if p < min_token_prob:
            break
        tokens.append(token)
        cumulative.append(p)
        alive = [o for o in alive if o[1] + step < len(o[0]) and o[0][o[1] + step] == token]
    serial = alive[0][2] if tokens else None
    return SuffixDraft(tokens, cumulative, match.length, serial)


@dataclass(frozen=True)
class SuffixConfig:
    """SuffixDecoding's knobs (its defaults where it has them) and the cache's budget."""

    max_cached_tokens: int = 1 << 18  # the cache's budget over every scope; 0 = no cache (own text only)
    anchor: int = 2  # tokens a match must share at least
    max_depth: int = 64  # longest match considered
    max_candidates: int = 32  # most recent occurrences of the anchor extended per lookup
    spec_factor: float = 1.0  # a draft is at most spec_factor x match length (+ spec_offset) tokens
    spec_offset: float = 0.0
    min_token_prob: float = 0.1  # estimated probability that the whole draft is accepted, at least

    def __post_init__(self) -> None:
        if self.max_cached_tokens < 0 or self.anchor < 1 or self.max_depth < self.anchor or self.max_candidates < 1:
            raise ValueError("suffix config: need max_cached_tokens >= 0, 1 <= anchor <= max_depth, max_candidates >= 1")
        if not 0.0 <= self.min_token_prob <= 1.0 or self.spec_factor <= 0:
            raise ValueError("suffix config: need 0 <= min_token_prob <= 1 and spec_factor > 0")


class SuffixCache:
    """What the target wrote for earlier requests, one ``SuffixIndex`` per scope, under one budget
    of ``max_cached_tokens`` (least recently used documents go first; a document used for a draft
    counts as used). Thread-safe: a drafter service may draft from several threads."""

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self.scopes: dict[str, SuffixIndex] = {}
        self.recency: OrderedDict[int, str] = OrderedDict()  # serial -> scope, least recent first
        self.num_tokens = 0
        self.evicted_documents = 0
        self._next_serial = 1
        self._lock = threading.Lock()

    def new_document(self) -> int:
        """A serial for a document to come (never reused)."""
        with self._lock:
            serial = self._next_serial
            self._next_serial += 1
            return serial

    def add(self, scope: str, serial: int, tokens: Sequence[int], new: bool) -> None:
        """Append ``tokens`` to document ``serial`` of ``scope`` (``new``: its first tokens). A
        document evicted while its request still runs stays out."""
        budget = self.config.max_cached_tokens
        if budget == 0 or not tokens:
            return
        with self._lock:
            if new:
                self.recency[serial] = scope
            elif serial in self.recency:
                self.recency.move_to_end(serial)
            else:
                return
            index = self.scopes.get(scope)
            if index is None:
                index = self.scopes[scope] = SuffixIndex(self.config.anchor)
            index.add(serial, tokens)
            self.num_tokens += len(tokens)
            while self.num_tokens > budget and self.recency:
                old_serial, old_scope = self.recency.popitem(last=False)
                self._evict(old_scope, old_serial)

    def _evict(self, scope: str, serial: int) -> None:
        index = self.scopes[scope]
        self.num_tokens -= index.remove(serial)
        self.evicted_documents += 1
        if not index.documents:
            del self.scopes[scope]

    def draft(self, scope: str, context: Sequence[int], max_tokens: int, exclude: int | None) -> SuffixDraft:
        """The best candidate from ``scope``'s documents other than ``exclude`` (the request's own)."""
        config = self.config
        with self._lock:
            index = self.scopes.get(scope)
            if index is None:
                return NO_DRAFT
            candidate = index.draft(context, config, max_tokens, exclude)
            if candidate.serial is not None and candidate.serial in self.recency:
                self.recency.move_to_end(candidate.serial)
            return candidate

    def stats(self) -> dict:
        with self._lock:
            return {"tokens": self.num_tokens, "documents": len(self.recency), "scopes": len(self.scopes),
                    "evicted_documents": self.evicted_documents}


class AcceptanceCalibration:
    """How far the cache's own estimate (a continuation's share of the matched occurrences) is to be
    trusted: the target accepts a draft whose share is s with probability s x rate, given the
    drafts before it were accepted, with one rate per match length and per whether the session's
    previous draft was accepted whole (``copying``: the text is following an earlier one; right
    after a miss it has just left it). Learned from the outcomes (successes over summed shares, a
    Beta-like prior, older outcomes fading); shared by every scope (it holds no text). Thread-safe."""

    # Match lengths below each bound share a rate; the longest (max_depth 64 reached: the last 64
    # tokens are an earlier text's, a resent request's) one more.
    BUCKETS = (4, 8, 16, 32, 64)

    def __init__(self, prior_accepted: float = 2.0, prior_rejected: float = 1.0, keep: float = 0.998) -> None:
        self.prior = (prior_accepted, prior_rejected)
        self.keep = keep
        self.accepted = [0.0] * (2 * len(self.BUCKETS) + 2)
        self.weight = [0.0] * (2 * len(self.BUCKETS) + 2)
        self._lock = threading.Lock()

    def bucket(self, match_length: int, copying: bool) -> int:
        b = next((i for i, bound in enumerate(self.BUCKETS) if match_length < bound), len(self.BUCKETS))
        return 2 * b + int(copying)

    def rate(self, match_length: int, copying: bool) -> float:
        b = self.bucket(match_length, copying)
        a, r = self.prior
        return (self.accepted[b] + a) / (self.weight[b] + a + r)

    def estimates(self, cumulative_shares: Sequence[float], match_length: int, copying: bool) -> list[float]:
        """Per i, the estimated probability that drafts 1..i + 1 are all accepted."""
        rate, out, p, previous = self.rate(match_length, copying), [], 1.0, 1.0
        for cumulative in cumulative_shares:
            share = cumulative / previous
            previous = cumulative
            p *= min(1.0, share * rate)
            out.append(p)
        return out

    def record(self, draft: SuffixDraft, accepted: int, copying: bool) -> None:
        """A candidate's outcome: its first ``accepted`` tokens were what the target committed
        there, and the next one (if any) was not. Each token up to the miss was a trial."""
        trials = min(len(draft.tokens), accepted + 1)
        if trials == 0:
            return
        shares = [c / p for c, p in zip(draft.cumulative_probs, [1.0, *draft.cumulative_probs])]
        b = self.bucket(draft.match_length, copying)
        with self._lock:
            for i in range(len(self.weight)):  # every bucket fades, so an idle one does not stay stale
                self.accepted[i] *= self.keep
                self.weight[i] *= self.keep
            self.accepted[b] += accepted
            self.weight[b] += sum(shares[:trials])


COPYING_AFTER = 4  # a candidate right this far says the text is following an earlier one


class CandidateTracker:
    """Scores a session's candidates against the tokens the target then commits, whether or not
    they were verified (a candidate the loop trimmed to nothing still says whether it was right:
    under greedy decoding the committed tokens are what verifying it would have accepted). One
    candidate at a time, so a copy that is proposed again every round counts once per round it was
    tracked, not once per overlapping proposal. This is what lets a calibration that came to
    distrust the cache learn that it is right again without paying for a single verified draft."""

    def __init__(self, calibration: AcceptanceCalibration) -> None:
        self.calibration = calibration
        self.draft = NO_DRAFT
        self.matched = 0
        self.copying_at_proposal = False
        self.copying = False  # the last tracked candidate was right to its end

    def propose(self, draft: SuffixDraft) -> None:
        if not self.draft.tokens and draft.tokens:
            self.draft, self.matched, self.copying_at_proposal = draft, 0, self.copying

    def committed(self, tokens: Sequence[int]) -> None:
        draft = self.draft
        for actual in tokens:
            if not draft.tokens:
                return
            if draft.tokens[self.matched] != actual:
                self._resolve(missed=True)
                return
            self.matched += 1
            if self.matched >= COPYING_AFTER:
                self.copying = True
            if self.matched == len(draft.tokens):
                self._resolve(missed=False)
                return

    def _resolve(self, missed: bool) -> None:
        self.calibration.record(self.draft, self.matched, self.copying_at_proposal)
        self.copying = not missed
        self.draft, self.matched = NO_DRAFT, 0


def draft_limit(config: SuffixConfig, match_length: int, max_tokens: int) -> int:
    """At most ``spec_factor`` x match length + ``spec_offset`` tokens, and ``max_tokens``."""
    return max(0, min(max_tokens, math.floor(config.spec_factor * match_length + config.spec_offset)))


class SuffixDraftSession(DraftSession):
    """One request: its own prompt + output (an index of one document, never shared) and, when the
    drafter has a cache, its scope there, which its output joins as it is committed."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, drafter: SuffixDrafter,
                 scope: str) -> None:
        super().__init__(prompt_ids, params)
        self.config = drafter.config
        self.cache = drafter.cache
        self.scope = scope
        self.own = SuffixIndex(self.config.anchor)
        self.own.add(0, self.tokens)
        self.serial = self.cache.new_document() if self.cache is not None else None
        self.lead_in = list(prompt_ids[-PROMPT_LEAD_IN:])  # goes in before the first output token
        self.calibration = drafter.calibration
        self.tracker = CandidateTracker(self.calibration)

    def extend(self, committed: list[int]) -> None:
        committed = [int(t) for t in committed]
        self.tracker.committed(committed)
        super().extend(committed)
        self.own.add(0, committed)
        if self.cache is not None and committed:
            new = self.lead_in is not None
            self.cache.add(self.scope, self.serial, [*(self.lead_in or ()), *committed], new)
            self.lead_in = None

    def finish(self, committed: list[int]) -> None:
        self.extend(committed)

    def propose(self, num_draft_tokens: int) -> DraftProposal:
        if num_draft_tokens <= 0:
            return DraftProposal()
        config, context = self.config, self.tokens
        best = self.own.draft(context, config, num_draft_tokens)
        if self.cache is not None:
            shared = self.cache.draft(self.scope, context, num_draft_tokens, self.serial)
            if shared.score > best.score:
                best = shared
        if not self.assumed:  # a draft-ahead block continues tokens not committed yet: not comparable
            self.tracker.propose(best)
        estimates = self.calibration.estimates(best.cumulative_probs, best.match_length, self.tracker.copying)
        return DraftProposal(list(best.tokens), None, estimates)


class SuffixDrafter(Drafter):
    """Suffix drafting over the request's own text and, with ``config.max_cached_tokens`` > 0, a
    cache of earlier outputs shared by the requests of one scope (``start_in_scope``)."""

    name = "suffix"
    estimates_acceptance = True

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.calibration = AcceptanceCalibration()
        self.cache = SuffixCache(self.config) if self.config.max_cached_tokens > 0 else None

    def start(self, prompt_ids: list[int], params: SamplingParams) -> DraftSession:
        return SuffixDraftSession(prompt_ids, params, self, "")

    def start_in_scope(self, prompt_ids: list[int], params: SamplingParams, scope: str) -> DraftSession:
        """Requests of different scopes never draft from each other's text."""
        return SuffixDraftSession(prompt_ids, params, self, scope)


    def remember(self, scope: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Cache the output of a request that drafted otherwise (a draft model, plain decoding), so
        that suffix lookup, and ``auto``'s measure of it, see every output of the scope."""
        if self.cache is not None and output_ids:
            self.cache.add(scope, self.cache.new_document(),
                           [*prompt_ids[-PROMPT_LEAD_IN:], *(int(t) for t in output_ids)], new=True)


def cache_scope_key(tenant: str, cache_scope: str) -> str:
    """One string for (tenant, the client's cache scope); a tenant is a hex digest (no "/"), so
    two different pairs never meet in one key."""
    return f"{tenant}/{cache_scope}"
