"""Sessions as llama.cpp sequences: the ``gguf`` runtime's model and KV caches.

``GgufModel`` holds one llama.cpp context of ``sequences`` sequences; each session's cache
(``GgufKV``) is one sequence id. A pass (``GgufModel.forward``) is one batch over every session's
new tokens, at each session's own positions, with logits only for the rows a verdict reads;
rolling back is removing the sequence's positions from a length on. The contract is the lean
runtime's (``specdec.lean.LeanModel.forward`` / ``LeanKV``), so ``KVSession`` and the batched pass
drive both alike.

Exactness: a position's logits depend on neither how its passes were cut nor which sequences
shared them, bit for bit (tests/test_gguf_runtime.py), given two settings. Flash attention: without
it a pass of several tokens rounds its attention differently from one-token passes. A KV stream per
sequence (``kv_unified`` off): a sequence's positions then always lie in its stream's cells in
order (rollback frees only its tail), so attention accumulates them in the same order whatever
happened before; in one unified buffer other sessions' freed cells interleave and the order, hence
the rounding, varies. Greedy speculation on this runtime therefore equals its own
one-token-at-a-time decoding, token for token.
"""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path

import numpy as np
import torch

from specdec.gguf import SequencesExhausted
from specdec.gguf.binding import LlamaContext

SEQUENCES_ENV = "SPECDEC_GGUF_SEQUENCES"  # sequences (sessions) one context holds
POSITIONS_ENV = "SPECDEC_GGUF_POSITIONS"  # positions per sequence (each sequence's KV is allocated up front)
THREADS_ENV = "SPECDEC_GGUF_THREADS"  # llama.cpp's threads (default: torch's, which `serve --threads` sets)
FLASH_ATTENTION_ENV = "SPECDEC_GGUF_FLASH_ATTENTION"  # on (default) | auto | off
POLL_ENV = "SPECDEC_GGUF_POLL"  # ggml's polling between passes, 0 (default: sleep at once) .. 100
# KV memory is sequences x positions x the model's bytes per position, allocated (and written) when
# the context is made: the default caps the sequences whatever the service's session limit.
DEFAULT_SEQUENCES = 16
# llama.cpp computes a sequence's rows by another path (other rounding) once one of its ubatches holds
# 64 of its tokens: measured bitwise equal to one-token decoding up to 63 tokens, not from 64. Every
# pass feeds a sequence at most this many tokens per decode call, so a row's logits do not depend on
# how its sequence's tokens were split into passes (a prompt prefilled whole, or in chunks beside
# other sessions' rounds under load).
MAX_TOKENS_PER_DECODE = 63
DEFAULT_POSITIONS = 2048


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"${name} must be a whole number, not {value!r}") from None
    if number < 1:
        raise ValueError(f"${name} must be at least 1")
    return number


def default_threads() -> int:
    # torch's count: the cores this process may use, or what `specdec serve --threads` set
    return _env_int(THREADS_ENV, torch.get_num_threads())


class GgufKV:
    """One session's cache: a sequence of the model's context, positions ``0 .. length``.

    ``length`` moves only once a pass has succeeded (a failed pass removes what it fed), and the
    sequence returns to the model when the cache is released or collected."""

    def __init__(self, model: GgufModel, seq_id: int) -> None:
        self.model = model
        self.seq_id = seq_id
        self.length = 0
        self._finalizer = weakref.finalize(self, model._release, seq_id)

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: drop that many trailing positions; otherwise keep that many (``LeanKV.crop``)."""
        keep = self.length + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove
        keep = max(0, min(self.length, keep))
        if keep < self.length:
            self.model.remove(self.seq_id, keep)
            self.length = keep

    def release(self) -> None:
        self._finalizer()


class GgufModel:
    """A GGUF file in one llama.cpp context, run in passes over several sessions' sequences."""

    def __init__(self, path: str | Path, sequences: int | None = None, positions: int | None = None,
                 threads: int | None = None) -> None:
        self.path = Path(path)
        sequences = _env_int(SEQUENCES_ENV, min(sequences or DEFAULT_SEQUENCES, DEFAULT_SEQUENCES))
        positions = positions or _env_int(POSITIONS_ENV, DEFAULT_POSITIONS)
        flash = os.environ.get(FLASH_ATTENTION_ENV, "on")
        if flash not in ("auto", "on", "off"):
            raise ValueError(f"${FLASH_ATTENTION_ENV}={flash!r}: choose from auto, on, off")
        poll = int(os.environ.get(POLL_ENV) or 0)
        if not 0 <= poll <= 100:
            raise ValueError(f"${POLL_ENV} must be between 0 and 100")
        self.context = LlamaContext(self.path, sequences, positions, threads or default_threads(),
                                    flash_attention=flash, poll=poll)
        self.vocab_size = self.context.vocab_size
        self.max_positions = min(self.context.context_length, self.context.positions)
        self._lock = threading.Lock()  # one llama.cpp call at a time
        self._free = list(range(self.context.sequences - 1, -1, -1))  # pop() takes the lowest id
        self._released: list[int] = []  # freed by sessions, not yet cleared in llama.cpp

    @property
    def kv_bytes_per_position(self) -> int:
        """f16 keys and values of every layer for one position."""
        arch = self.context.meta("general.architecture") or "llama"
        heads = int(self.context.meta(f"{arch}.attention.head_count") or 1)
        kv_heads = int(self.context.meta(f"{arch}.attention.head_count_kv") or heads)
        return 2 * 2 * self.context.num_layers * self.context.hidden_size * kv_heads // heads

    def describe(self) -> dict:
        """What the runtime holds, for logs and GetInfo-style reports."""
        return {"file": str(self.path), "model_bytes": self.context.model_bytes, "sequences": self.context.sequences,
                "positions_per_sequence": self.context.positions, "threads": self.context.threads,
                "kv_bytes": self.kv_bytes_per_position * self.context.positions * self.context.sequences,
                "cpu_variant": self.context.lib.variant}

    def new_kv(self) -> GgufKV:
        """A free sequence, empty. ``SequencesExhausted`` when every one is held."""
        if not self._free and self._released:
            with self._lock:
                self._clear_released()
        if not self._free:
            raise SequencesExhausted(f"all {self.context.sequences} sequences of {self.path.name} are in use "
                                     f"(${SEQUENCES_ENV}, or the service's --max-sessions)")
        return GgufKV(self, self._free.pop())

    def _release(self, seq_id: int) -> None:
        # Any thread, even during a pass: the sequence is cleared before the next pass or allocation.
        self._released.append(seq_id)

    def _clear_released(self) -> None:
        while self._released:
            seq_id = self._released.pop()
            self.context.remove(seq_id, 0)
            self._free.append(seq_id)

    def remove(self, seq_id: int, start: int) -> None:
        with self._lock:
            self.context.remove(seq_id, start)

    @torch.inference_mode()
    def forward(self, caches: list[GgufKV], feeds: list[list[int]], num_logits: list[int]) -> torch.Tensor:
        """One pass: each cache's ``feeds`` tokens after its ``length``; fp32 logits [sum(num_logits), V],
        the last ``num_logits[i]`` positions of row i, row after row. Every cache grows by its feed,
        or (the pass failed) none does. Feeds longer than ``MAX_TOKENS_PER_DECODE`` go in several
        decode calls, that many tokens of each at a time."""
        sizes = [len(feed) for feed in feeds]
        for cache, size in zip(caches, sizes):
            if cache.length + size > self.context.positions:
                raise ValueError(f"a session of {cache.length + size} positions exceeds the gguf runtime's "
                                 f"{self.context.positions} per sequence (${POSITIONS_ENV})")
        rows: list[list[np.ndarray]] = [[] for _ in caches]  # each cache's logits, piece after piece
        with self._lock:
            self._clear_released()
            try:
                for start in range(0, max(sizes, default=0), MAX_TOKENS_PER_DECODE):
                    self._decode_piece(caches, feeds, num_logits, start, rows)
            except BaseException:
                for cache in caches:  # pieces and chunks that went through stay in llama.cpp's memory
                    self.context.remove(cache.seq_id, cache.length)
                raise
        for cache, size in zip(caches, sizes):
            cache.length += size
        return torch.from_numpy(np.concatenate([row for parts in rows for row in parts]))

    def _decode_piece(self, caches: list[GgufKV], feeds: list[list[int]], num_logits: list[int], start: int,
                      rows: list[list[np.ndarray]]) -> None:
        """One decode call over tokens ``start .. start + MAX_TOKENS_PER_DECODE`` of each feed (those
        that reach that far); the logits of the rows each feed wants go to ``rows``."""
        members = [i for i, feed in enumerate(feeds) if len(feed) > start]
        pieces = [feeds[i][start:start + MAX_TOKENS_PER_DECODE] for i in members]
        sizes = [len(piece) for piece in pieces]
        total = sum(sizes)
        tokens = np.fromiter((t for piece in pieces for t in piece), dtype=np.int32, count=total)
        positions = np.concatenate([np.arange(caches[i].length + start, caches[i].length + start + n, dtype=np.int32)
                                    for i, n in zip(members, sizes)])
        seq_ids = np.repeat(np.array([caches[i].seq_id for i in members], dtype=np.int32), sizes)
        want = np.zeros(total, dtype=np.int8)
        counts = []
        end = 0
        for i, size in zip(members, sizes):
            # The feed's wanted rows are its last num_logits[i]; this piece holds those past first_wanted.
            first_wanted = len(feeds[i]) - num_logits[i] - start
            wanted = max(0, size - max(0, first_wanted))
            want[end + size - wanted: end + size] = 1
            counts.append(wanted)
            end += size
        logits = self.context.decode(tokens, positions, seq_ids, want)
        offset = 0
        for i, wanted in zip(members, counts):
            if wanted:
                rows[i].append(logits[offset: offset + wanted])
                offset += wanted

    def close(self) -> None:
        self.context.close()
