"""Stopping and streaming text: where a completion ends and what text each chunk carries.

Tokens arrive in blocks (accepted drafts + one), but stopping is decided token by token, exactly
as target-only decoding would: the completion ends at the first EOS / stop token id (included in
``token_ids``, like ``generate``), at the token whose text completes a stop string (the token is
kept; the text is cut before the stop string), or at ``max_new_tokens``. Nothing after the stop is
emitted or counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.sampling import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class Chunk:
    """Newly committed completion tokens and the text they add."""

    token_ids: list[int]
    text: str


class CompletionBuilder:
    """Accumulates one completion, deciding stops and producing safe text deltas."""

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.params = params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        self.stop_token_ids = frozenset(stop_ids)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._emitted_text = ""
        self._final_text: str | None = None  # set once a stop string cut the text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._final_text if self._final_text is not None else self._decode()

    def _decode(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _stop_string_cut(self, text: str, search_from: int) -> int | None:
        cuts = [
            i for s in self.params.stop if (i := text.find(s, max(0, search_from - len(s) + 1))) >= 0
        ]
        return min(cuts) if cuts else None

    def add(self, tokens: list[int]) -> Chunk:
        """Append committed tokens up to the first stop; return what is new for the client."""
        if self.finished:
            return Chunk([], "")
        accepted: list[int] = []
        previous_text = self._decode() if self.params.stop else ""
        for token in tokens:
            self.token_ids.append(int(token))
            accepted.append(int(token))
            if int(token) in self.stop_token_ids:
                self.finish_reason = FINISH_STOP
            elif self.params.stop:
                text = self._decode()
                # A trailing U+FFFD is an incomplete UTF-8 character that this token may have
                # completed in place, so a stop string may end there: search from before it.
                cut = self._stop_string_cut(text, len(previous_text.rstrip("\ufffd")))
                if cut is not None:
                    self._final_text = text[:cut]
                    self.finish_reason = FINISH_STOP
                previous_text = text
            if not self.finished and len(self.token_ids) >= self.params.max_new_tokens:
                self.finish_reason = FINISH_LENGTH
            if self.finished:
                break
        return Chunk(accepted, self._text_delta())

    def _text_delta(self) -> str:
        if self._final_text is not None:
            safe = self._final_text
        else:
            safe = self._decode()
            if not self.finished:
                # An incomplete UTF-8 sequence decodes to U+FFFD until its last byte arrives.
                safe = safe.rstrip("\ufffd")
                safe = safe[: len(safe) - self._stop_prefix_overlap(safe)]
        if not safe.startswith(self._emitted_text):
            # The tokenizer re-merged earlier text; never retract what the client has.
            return ""
        delta = safe[len(self._emitted_text):]
        self._emitted_text = safe
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
