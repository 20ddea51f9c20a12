"""A GGUF file as a ``LoadedModel`` on the ``gguf`` runtime: its tokenizer (converted once from the
file's own metadata and cached) and its vocabulary facts."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from specdec.cache import cache_dir, publishing
from specdec.gguf.runtime import GgufModel
from specdec.lm import LoadedModel, ModelLoadError

log = logging.getLogger(__name__)
METADATA_BYTES = 16 << 20  # a GGUF's metadata (49k-token vocabularies take ~2 MB) precedes its tensors


def gguf_tokenizer(path: Path):
    """transformers' tokenizer for the GGUF file at ``path``, built from the file's metadata once and
    kept in the cache, keyed by a hash of the file's head (its metadata, the tokenizer's included):
    copies of a file, wherever they lie, share one entry."""
    from transformers import AutoTokenizer

    with open(path, "rb") as file:
        key = hashlib.sha256(file.read(METADATA_BYTES)).hexdigest()[:16]
    target = cache_dir() / "tokenizers" / key
    if (target / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with publishing(target, "tokenizer_config.json") as staging:
        tokenizer.save_pretrained(staging)
    return tokenizer


def load_gguf_model(name: str, path: Path, sessions: int | None = None) -> LoadedModel:
    """The GGUF file at ``path`` on llama.cpp's CPU kernels, holding up to ``sessions`` sessions."""
    from specdec.gguf.binding import GgufUnavailable

    if not path.is_file():
        raise ModelLoadError(f"cannot load model {name!r}: no file {path}")
    try:
        runtime = GgufModel(path, sequences=sessions)
    except (GgufUnavailable, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {name!r} on the gguf runtime: {exc}") from exc
    tokenizer = gguf_tokenizer(path)
    eos = set(runtime.context.eos_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    loaded = LoadedModel(name=name, model=None, tokenizer=tokenizer, device=torch.device("cpu"),
                         vocab_size=min(len(tokenizer), runtime.vocab_size), eos_token_ids=tuple(sorted(eos)),
                         gguf=runtime)
    log.info("%s: gguf runtime (%s)", name, ", ".join(f"{k} {v}" for k, v in runtime.describe().items()))
    return loaded
