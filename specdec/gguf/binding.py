"""ctypes over ``native/specdec_llama.c``: load llama.cpp's library (the best CPU variant this host
runs) and drive one context.

Why our own binding: llama-cpp-python is the ecosystem's, but PyPI has only its source, whose
build compiles llama.cpp's ``common`` library and pip's wheel machinery besides the library
(twice the build time), and its package imports ``diskcache`` and ``jinja2`` even for the
low-level calls. We need a dozen calls; a C shim over ``llama.h`` keeps the struct layouts the
compiler's business.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.gguf.build import BASE_VARIANT, LIBRARIES, SHIM_LIBRARY, VARIANTS, BuildError, built_dir

CPU_VARIANT_ENV = "SPECDEC_GGUF_CPU"  # force a ggml-cpu variant (avx2, avx512) instead of the best the CPU runs
VERBOSE_ENV = "SPECDEC_GGUF_VERBOSE"  # 1: llama.cpp's own load/context log on stderr

# specdec_llama_fact() keys (native/specdec_llama.c)
N_VOCAB, N_CTX_TRAIN, N_EMBD, N_LAYER, EOS, EOT, N_CTX, N_CTX_SEQ, N_SEQ_MAX, N_BATCH = range(10)
FLASH_ATTENTION = {"auto": -1, "off": 0, "on": 1}

_lock = threading.Lock()
_library: Library | None = None


class GgufUnavailable(RuntimeError):
    """The llama.cpp library is not built (or cannot load) on this machine."""


def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def pick_variant(flags: frozenset[str]) -> str:
    """The best ggml-cpu variant whose instructions ``flags`` (a CPU's) all include; ``$SPECDEC_GGUF_CPU``
    overrides."""
    forced = os.environ.get(CPU_VARIANT_ENV)
    if forced:
        if forced not in {v.name for v in VARIANTS}:
            raise GgufUnavailable(f"{CPU_VARIANT_ENV}={forced!r}: choose from {', '.join(v.name for v in VARIANTS)}")
        return forced
    for variant in VARIANTS:
        if variant.cpu_flags <= flags:
            return variant.name
    raise GgufUnavailable(f"this CPU lacks the instructions of every built variant (the least: "
                          f"{', '.join(sorted(BASE_VARIANT.cpu_flags - flags))})")


@dataclass
class Library:
    """The loaded shim and which ggml-cpu variant it runs on."""

    shim: ctypes.CDLL
    directory: Path
    variant: str

    @property
    def system_info(self) -> str:
        return self.shim.specdec_llama_system_info().decode()


def _declare(shim: ctypes.CDLL) -> None:
    p, i32, u32, i64, u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64
    signatures = {
        "specdec_llama_init": (None, [ctypes.c_int]),
        "specdec_llama_system_info": (ctypes.c_char_p, []),
        "specdec_llama_open": (p, [ctypes.c_char_p, u32, u32, u32, i32, i32, i32, u32, ctypes.c_char_p,
                                   ctypes.c_size_t]),
        "specdec_llama_close": (None, [p]),
        "specdec_llama_fact": (i64, [p, i32]),
        "specdec_llama_model_bytes": (u64, [p]),
        "specdec_llama_meta": (i32, [p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
        "specdec_llama_set_threads": (i32, [p, i32]),
        "specdec_llama_decode": (i32, [p, i32, p, p, p, p, p]),
        "specdec_llama_seq_rm": (i32, [p, i32, i32, i32]),
        "specdec_llama_seq_pos_max": (i32, [p, i32]),
    }
    for name, (result, arguments) in signatures.items():
        function = getattr(shim, name)
        function.restype, function.argtypes = result, arguments


def library() -> Library:
    """llama.cpp, loaded once per process: its libraries in dependency order, the chosen variant's
    ``libggml-cpu`` in place of the base one (a library already loaded under a soname is the one
    every later library links to)."""
    global _library
    with _lock:
        if _library is not None:
            return _library
        directory = built_dir()
        if directory is None:
            raise GgufUnavailable("llama.cpp is not built here: run `make setup` (or python -m specdec.gguf.build)")
        variant = pick_variant(cpu_flags())
        lib = directory / "lib"
        mode = ctypes.RTLD_GLOBAL
        try:
            for name in LIBRARIES:
                path = lib / variant / name if name == "libggml-cpu.so.0" and variant != BASE_VARIANT.name else lib / name
                ctypes.CDLL(str(path), mode=mode)
            shim = ctypes.CDLL(str(lib / SHIM_LIBRARY), mode=mode)
        except OSError as exc:
            raise GgufUnavailable(f"cannot load llama.cpp from {lib}: {exc}") from exc
        _declare(shim)
        shim.specdec_llama_init(1 if os.environ.get(VERBOSE_ENV) == "1" else 0)
        _library = Library(shim, directory, variant)
        return _library


def available() -> bool:
    """Whether the runtime can run here (built and loadable)."""
    try:
        library()
    except (GgufUnavailable, BuildError):
        return False
    return True


class LlamaContext:
    """One model and one llama.cpp context of ``sequences`` sequences, ``positions`` each.

    Not thread-safe: one pass at a time (the services run passes on one worker thread).
    """

    def __init__(self, path: str | Path, sequences: int, positions: int, threads: int, batch: int = 512,
                 flash_attention: str = "on", poll: int = 0) -> None:
        self.lib = library()
        error = ctypes.create_string_buffer(512)
        # Each sequence its own KV stream (not unified): a sequence's attention then never reads
        # another's cells, so its logits do not depend on who shares the context.
        self._handle = self.lib.shim.specdec_llama_open(
            str(path).encode(), positions * sequences, sequences, batch, threads, 0,
            FLASH_ATTENTION[flash_attention], poll, error, len(error))
        if not self._handle:
            raise GgufUnavailable(error.value.decode(errors="replace"))
        fact = self.fact
        self.vocab_size = fact(N_VOCAB)
        self.context_length = fact(N_CTX_TRAIN)
        self.hidden_size = fact(N_EMBD)
        self.num_layers = fact(N_LAYER)
        self.sequences = fact(N_SEQ_MAX)
        self.positions = fact(N_CTX_SEQ)
        self.batch = fact(N_BATCH)
        # The file's end-of-sequence id, and its end-of-turn id where the file names one (llama.cpp
        # also guesses an end-of-turn id from token texts; a stop the model's own config lacks is not ours).
        named_eot = self.meta("tokenizer.ggml.eot_token_id") is not None
        self.eos_ids = tuple(sorted({t for t in (fact(EOS), fact(EOT) if named_eot else -1) if t >= 0}))
        self.model_bytes = int(self.lib.shim.specdec_llama_model_bytes(self._handle))
        self.threads = threads

    def fact(self, key: int) -> int:
        return int(self.lib.shim.specdec_llama_fact(self._handle, key))

    def meta(self, key: str) -> str | None:
        value = ctypes.create_string_buffer(4096)
        n = self.lib.shim.specdec_llama_meta(self._handle, key.encode(), value, len(value))
        return None if n < 0 else value.value.decode(errors="replace")

    def set_threads(self, threads: int) -> None:
        if not self.lib.shim.specdec_llama_set_threads(self._handle, threads):
            raise RuntimeError(f"llama.cpp: cannot start {threads} threads")
        self.threads = threads

    def decode(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray, want_logits: np.ndarray) -> np.ndarray:
        """One pass; the logits [outputs, vocab] (fp32) of the tokens ``want_logits`` marks, in order.
        ``RuntimeError`` if llama.cpp refuses it (positions it fed before failing stay: the caller
        removes them)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        positions = np.ascontiguousarray(positions, dtype=np.int32)
        seq_ids = np.ascontiguousarray(seq_ids, dtype=np.int32)
        want_logits = np.ascontiguousarray(want_logits, dtype=np.int8)
        out = np.empty((int(want_logits.sum()), self.vocab_size), dtype=np.float32)
        status = self.lib.shim.specdec_llama_decode(
            self._handle, len(tokens), tokens.ctypes.data, positions.ctypes.data, seq_ids.ctypes.data,
            want_logits.ctypes.data, out.ctypes.data)
        if status != 0:
            why = "no KV room for the pass" if status == 1 else f"llama_decode returned {status}"
            raise RuntimeError(f"llama.cpp: {why}")
        return out

    def remove(self, seq_id: int, start: int, end: int = -1) -> None:
        """Drop sequence ``seq_id``'s positions [start, end) (end -1: to its end)."""
        if not self.lib.shim.specdec_llama_seq_rm(self._handle, seq_id, start, end):
            raise RuntimeError(f"llama.cpp: cannot remove positions {start}..{end} of sequence {seq_id}")

    def last_position(self, seq_id: int) -> int:
        """The sequence's highest cached position, -1 when empty."""
        return int(self.lib.shim.specdec_llama_seq_pos_max(self._handle, seq_id))

    def close(self) -> None:
        if self._handle:
            self.lib.shim.specdec_llama_close(self._handle)
            self._handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
