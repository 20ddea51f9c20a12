"""Stopping and streaming text: where a completion ends and what text each chunk carries.

Tokens arrive in blocks (accepted drafts + one), but stopping is decided token by token, exactly
as target-only decoding would: the completion ends at the first EOS / stop token id (included in
``token_ids``, like ``generate``), at the token whose text completes a stop string (the token is
kept; the text is cut before the stop string), or at ``max_new_tokens``. Nothing after the stop is
emitted or counted.

Text is decoded incrementally (``IncrementalDecoder``): each token costs a decode of a window of a
few tokens, never of the whole completion, so a long stream does not slow down the event loop that
every stream shares. Stop strings are searched only in the text not yet sent to the client.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.wire_types import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
INCOMPLETE = "\ufffd"  # what an incomplete UTF-8 sequence decodes to until its last byte arrives
DECODE_CONTEXT = 8  # at most this many settled tokens are decoded again as a new token's left context
MAX_PENDING = 8  # a UTF-8 character spans at most 4 byte tokens: past this many, text is settled as is


@dataclass(frozen=True)
class Chunk:
    """Newly committed completion tokens and the text they add."""

    token_ids: list[int]
    text: str


class IncrementalDecoder:
    """The text of a growing list of token ids, one token at a time, over a bounded window.

    Invariant: ``"".join(pieces)`` is the text of ``ids[:read]``, and ``ids[prefix:read]`` is
    the left context decoded again with each new token (a tokenizer may render a token
    differently after its neighbour, e.g. a leading space). A token whose bytes end in an
    incomplete UTF-8 character adds nothing until the character completes (or ``MAX_PENDING``
    tokens have passed; ``flush`` at the end releases whatever is left). The window restarts at
    every token that settled text and keeps at most ``DECODE_CONTEXT`` settled tokens (tokens
    that render as nothing, such as skipped special tokens, would otherwise widen it), so it
    spans a few tokens, not the completion.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self.prefix = 0
        self.read = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=True)

    def _settled_context(self) -> str:
        """The window's left context as decoded before: what a new decode of the window starts with."""
        return self._decode(self.prefix, self.read) if self.read > self.prefix else ""

    def push(self, token: int) -> str:
        """Append ``token``; the text it settles (maybe empty)."""
        self.ids.append(token)
        settled = self._settled_context()
        window = self._decode(self.prefix)
        waiting = window.endswith(INCOMPLETE) or not window.startswith(settled)
        if waiting and len(self.ids) - self.read < MAX_PENDING:
            return ""  # wait for the rest of the character (or for the tokenizer to settle)
        added = window[len(settled):]
        self.prefix, self.read = (self.read, len(self.ids)) if added else (self.prefix, len(self.ids))
        self.prefix = max(self.prefix, self.read - DECODE_CONTEXT)
        if added:
            self.pieces.append(added)
        return added

    def flush(self) -> str:
        """The text of the tokens still pending (an incomplete character decodes as U+FFFD)."""
        added = self._decode(self.prefix)[len(self._settled_context()):]
        self.prefix = self.read = len(self.ids)
        if added:
            self.pieces.append(added)
        return added

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class CompletionBuilder:
    """Accumulates one completion, deciding stops and producing safe text deltas."""

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stop_token_ids = params.stop_ids(eos_token_ids)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._decoder = IncrementalDecoder(tokenizer)
        self._unsent = ""  # decoded text not yet sent: held back as a possible stop string's start
        self._final_text: str | None = None  # set once the completion finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The completion's text: everything decoded so far, or (finished) cut before a stop string."""
        return self._final_text if self._final_text is not None else self._decoder.text

    def _earliest_stop(self, text: str) -> int | None:
        cuts = [i for s in self.params.stop if (i := text.find(s)) >= 0]
        return min(cuts) if cuts else None

    def add(self, tokens: list[int]) -> Chunk:
        """Append committed tokens up to the first stop; return what is new for the client."""
        if self.finished:
            return Chunk([], "")
        accepted: list[int] = []
        cut = None
        for token in tokens:
            token = int(token)
            self.token_ids.append(token)
            accepted.append(token)
            self._unsent += self._decoder.push(token)
            if token in self.stop_token_ids:
                self.finish_reason = FINISH_STOP
            elif self.params.stop:
                # A stop string cannot begin in text already sent (its start would have been held
                # back) nor lie wholly in text searched before, so the unsent text is enough.
                cut = self._earliest_stop(self._unsent)
                if cut is not None:
                    self.finish_reason = FINISH_STOP
            if not self.finished and len(self.token_ids) >= self.params.max_new_tokens:
                self.finish_reason = FINISH_LENGTH
            if self.finished:
                break
        if self.finished and cut is None:
            delta = self._release_all()
        elif self.finished:
            delta = self._unsent[:cut]
            full = self._decoder.text
            self._final_text = full[: len(full) - len(self._unsent) + cut]
            self._unsent = ""
        else:
            held = self._stop_prefix_overlap(self._unsent)
            delta, self._unsent = self._unsent[: len(self._unsent) - held], self._unsent[len(self._unsent) - held:]
        return Chunk(accepted, delta)

    def end_at_context(self) -> Chunk:
        """Finish by length because the model's context is full (no position left to verify at):
        the text held back for a possible stop string and any pending bytes are released."""
        if self.finished:
            return Chunk([], "")
        self.finish_reason = FINISH_LENGTH
        return Chunk([], self._release_all())

    def _release_all(self) -> str:
        """Finished without a stop string: every decoded byte is the text, and all that is unsent goes."""
        delta = self._unsent + self._decoder.flush()
        self._unsent, self._final_text = "", self._decoder.text
        return delta

    def _stop_prefix_overlap(self, text: str) -> int:
        """Length of the longest tail of ``text`` that could begin a stop string (held back)."""
        longest = 0
        for s in self.params.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
