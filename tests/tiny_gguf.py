"""A tiny random Llama as a GGUF file, with the embedded model's tokenizer, built in-test (issue #43)."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf import GGUFWriter, LlamaFileType
from gguf.quants import quantize

# Weights' std: at 0.1 or less, greedy decoding of the random model soon repeats one token over and
# over; at 0.2 it gives varied tokens.
INIT_STD = 0.2
# file_type -> (general.file_type, 2-D weights' type, token_embd's type). Like the shipped Q4_1 file,
# a Q4_1 model keeps its embedding (which is also the tied output projection) in Q8_0.
FILE_TYPES = {
    "f32": (LlamaFileType.ALL_F32, Q.F32, Q.F32),
    "f16": (LlamaFileType.MOSTLY_F16, Q.F16, Q.F16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, Q.Q8_0, Q.Q8_0),
    "q4_1": (LlamaFileType.MOSTLY_Q4_1, Q.Q4_1, Q.Q8_0),
}
_SCALARS = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
            V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}


def _read_value(buf, offset: int, vtype: V) -> tuple[object, V | None, int]:
    """(value, array item type, next offset) of one little-endian GGUF metadata value at ``offset``."""
    if vtype == V.STRING:
        (length,) = struct.unpack_from("<Q", buf, offset)
        return buf[offset + 8:offset + 8 + length].decode("utf-8"), None, offset + 8 + length
    if vtype == V.ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, offset)
        item_type, offset = V(item_type), offset + 12
        if item_type in _SCALARS:
            fmt = f"<{count}{_SCALARS[item_type]}"
            return list(struct.unpack_from(fmt, buf, offset)), item_type, offset + struct.calcsize(fmt)
        items = []
        for _ in range(count):
            item, _, offset = _read_value(buf, offset, item_type)
            items.append(item)
        return items, item_type, offset
    fmt = "<" + _SCALARS[vtype]
    return struct.unpack_from(fmt, buf, offset)[0], None, offset + struct.calcsize(fmt)


def tokenizer_metadata(gguf_path: Path) -> list[tuple[str, object, V, V | None]]:
    """Every ``tokenizer.*`` key of a GGUF file as (key, value, type, array item type), in file order.

    A direct parse of the metadata section: gguf.GGUFReader takes seconds on the ~98k token and
    merge strings (a numpy view per string).
    """
    with open(gguf_path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _, kv_count = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{gguf_path} is not a little-endian GGUF v2+ file")
        offset, fields = 24, []
        for _ in range(kv_count):
            key, _, offset = _read_value(buf, offset, V.STRING)
            (vtype,) = struct.unpack_from("<I", buf, offset)
            value, item_type, offset = _read_value(buf, offset + 4, V(vtype))
            if key.startswith("tokenizer."):
                fields.append((key, value, V(vtype), item_type))
        return fields


def build_tiny_gguf(path: Path, *, file_type: str = "f32", layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, intermediate: int = 128, context: int = 2048, seed: int = 0) -> Path:
    """A random Llama GGUF at ``path`` (deterministic for ``seed``) with the embedded target's tokenizer.

    Its output projection is tied to ``token_embd`` (no ``output.weight``), as in SmolLM2. Quantized
    types need ``hidden`` and ``intermediate`` to be multiples of 32 (the block size).
    """
    from specdec.models import _embedded_gguf_path

    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type must be one of {sorted(FILE_TYPES)}, not {file_type!r}")
    llama_file_type, matrix_type, embedding_type = FILE_TYPES[file_type]
    tokenizer = tokenizer_metadata(_embedded_gguf_path())
    vocab_size = len(next(value for key, value, _, _ in tokenizer if key == "tokenizer.ggml.tokens"))
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)

    def matrix(rows: int, columns: int) -> np.ndarray:
        return rng.normal(0.0, INIT_STD, (rows, columns)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + rng.normal(0.0, 0.1, hidden)).astype(np.float32)

    tensors = {"token_embd.weight": (matrix(vocab_size, hidden), embedding_type)}
    for layer in range(layers):
        block = f"blk.{layer}."
        tensors.update({
            block + "attn_norm.weight": (norm(), Q.F32),
            block + "attn_q.weight": (matrix(heads * head_dim, hidden), matrix_type),
            block + "attn_k.weight": (matrix(kv_heads * head_dim, hidden), matrix_type),
            block + "attn_v.weight": (matrix(kv_heads * head_dim, hidden), matrix_type),
            block + "attn_output.weight": (matrix(hidden, heads * head_dim), matrix_type),
            block + "ffn_norm.weight": (norm(), Q.F32),
            block + "ffn_gate.weight": (matrix(intermediate, hidden), matrix_type),
            block + "ffn_up.weight": (matrix(intermediate, hidden), matrix_type),
            block + "ffn_down.weight": (matrix(hidden, intermediate), matrix_type),
        })
    tensors["output_norm.weight"] = (norm(), Q.F32)

    writer = GGUFWriter(path, "llama")  # writes general.architecture
    writer.add_name(f"tiny-random-llama-{file_type}")
    writer.add_file_type(int(llama_file_type))
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab_size)
    for key, value, vtype, item_type in tokenizer:
        writer.add_key_value(key, value, vtype, item_type)
    for name, (weights, qtype) in tensors.items():
        writer.add_tensor(name, quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
