"""The verdicts' target features the gateway holds for a feature-level drafter (EAGLE) until its
next proposal, as received: the gateway never decodes them (the drafter validates them)."""

from __future__ import annotations

from specdec.wire_types import EncodedFeatures


class FeatureRelay:
    """The verdicts' features a relay (the gateway) holds until the drafter's next proposal: the
    newest ones, at most ``max_bytes`` of them (callers pass the message size limit), as received.

    Why a window. A session's draft-length policy may draft nothing for many rounds (k = 0: plain
    decoding wins), and every verdict still brings its features; all of them in one proposal would
    pass the message limit (4 MiB holds 512 positions of a 4096-wide target) and end the drafter
    stream. So only the newest that fit are kept, and the drafter starts its history afresh at the
    window's first position when it is past what it holds (``FeatureHistory``): the head then drafts
    from the window on, as after a long prompt's windowed prefill. Forwarding nothing while not
    drafting instead would leave the first proposal after a plain stretch without the features of
    its recent context. Drafts never decide the output (the verifier does): a shorter history can
    only cost acceptance.

    Parts are consecutive in the order verdicts arrive, except that a migrated verifier resends from
    an earlier position (its rows replace the held ones from there) and a trimmed window leaves a
    gap before it. The payload is never decoded here: the drafter validates it.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._parts: list[EncodedFeatures] = []
        self.nbytes = 0

    def add(self, features: EncodedFeatures) -> None:
        if len(features) == 0:
            return
        parts = self._parts
        while parts and (parts[-1].start >= features.start or parts[-1].width != features.width):
            self.nbytes -= parts.pop().wire_bytes  # resent (or of another width): the newer rows win
        if parts and parts[-1].end > features.start:  # overlaps the last part's tail
            last = parts.pop()
            self.nbytes -= last.wire_bytes
            parts.append(last.head(features.start - last.start))
            self.nbytes += parts[-1].wire_bytes
        if parts and parts[-1].end < features.start:  # a gap: what was held can never join these
            self.clear()
        parts.append(features)
        self.nbytes += features.wire_bytes
        while self.nbytes > self.max_bytes:  # drop the oldest rows
            oldest = parts.pop(0)
            self.nbytes -= oldest.wire_bytes
            excess = self.nbytes + oldest.wire_bytes - self.max_bytes
            rows = -(-excess // oldest.row_bytes) if oldest.row_bytes else oldest.count
            kept = oldest.tail(oldest.count - rows)
            if len(kept) and kept.wire_bytes + self.nbytes <= self.max_bytes:
                parts.insert(0, kept)
                self.nbytes += kept.wire_bytes

    def take(self) -> EncodedFeatures | None:
        """Everything held, as one payload (None for none), and empty the relay."""
        if not self._parts:
            return None
        first = self._parts[0]
        joined = EncodedFeatures(first.start, sum(p.count for p in self._parts), first.width,
                                 b"".join(p.data for p in self._parts))
        self.clear()
        return joined

    def clear(self) -> None:
        self._parts.clear()
        self.nbytes = 0
