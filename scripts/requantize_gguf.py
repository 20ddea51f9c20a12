"""Another quantization of a GGUF file's weights, for the bench to compare llama.cpp's speed on it.

    python scripts/requantize_gguf.py SRC --type q8_0|f16|f32 --out FILE [--no-check]
    python scripts/requantize_gguf.py embedded --type q8_0 --out smollm2-q8_0.gguf

Each tensor of SRC is dequantized to fp32 and quantized to ``--type`` with the ``gguf`` Python
package; 1-D tensors (norms) stay F32, as llama.cpp's own quantizer keeps them. Every metadata
field is copied, except ``general.file_type``, which names the new type. Then (unless
``--no-check``) llama.cpp loads the result on the gguf runtime and decodes a few tokens greedily.

The weights come from SRC as it is: from the shipped Q4_1 file, an F16 / F32 output holds the
Q4_1 values (up to F16's rounding) and a Q8_0 one those values rounded again to Q8_0's grid, none
more accurate than Q4_1 (and each type's kernels round differently: greedy text soon departs from
the Q4_1 file's). Compare speed with it (the bench's ``llamacpp`` system on either file), not quality.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize
from tqdm import tqdm

# --type -> (general.file_type, the type of every tensor of two or more dimensions)
TYPES = {
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, GGMLQuantizationType.Q8_0),
    "f16": (LlamaFileType.MOSTLY_F16, GGMLQuantizationType.F16),
    "f32": (LlamaFileType.ALL_F32, GGMLQuantizationType.F32),
}
# Fields the reader makes up from the header (not metadata) and the ones the writer sets itself.
SKIPPED_FIELDS = ("GGUF.", "general.architecture", "general.file_type", "general.alignment")
CHECK_PROMPT = "The capital of France is"
CHECK_TOKENS = 12


def source_path(name: str) -> Path:
    if name == "embedded":
        from specdec.models import _embedded_gguf_path

        return _embedded_gguf_path()
    path = Path(name)
    if not path.is_file():
        raise SystemExit(f"error: SRC: no file {path}")
    return path


def copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    for key, field in reader.fields.items():
        if key == "general.alignment":
            writer.add_custom_alignment(int(field.contents()))
        if key.startswith(SKIPPED_FIELDS):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type)


def requantize(src: Path, kind: str, out: Path, progress: bool = True) -> Path:
    """Write ``src``'s weights as ``kind`` (a key of ``TYPES``) to ``out`` (through a temporary file)."""
    file_type, matrix_type = TYPES[kind]
    reader = GGUFReader(src)
    architecture = reader.fields["general.architecture"].contents()
    partial = out.with_name(out.name + ".partial")
    writer = GGUFWriter(partial, architecture)
    try:
        copy_metadata(reader, writer)
        writer.add_file_type(int(file_type))
        total = sum(int(t.n_elements) for t in reader.tensors)
        with tqdm(total=total, unit="weight", unit_scale=True, desc=f"to {kind}", disable=not progress) as bar:
            for tensor in reader.tensors:
                weights = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
                qtype = matrix_type if weights.ndim > 1 else GGMLQuantizationType.F32
                writer.add_tensor(tensor.name, quantize(weights, qtype), raw_dtype=qtype)
                bar.update(int(tensor.n_elements))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=progress)
        writer.close()
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def check(path: Path) -> str:
    """Load ``path`` on llama.cpp (the gguf runtime) and decode a few tokens greedily; the text."""
    from specdec.kv import KVSession
    from specdec.models import load_model
    from specdec.sampling import greedy_tokens

    lm = load_model(str(path), device="cpu", runtime="gguf", sessions=1)
    session = KVSession(lm)
    try:
        tokens = list(lm.tokenizer(CHECK_PROMPT)["input_ids"])
        prompt = len(tokens)
        for _ in range(CHECK_TOKENS):
            tokens.append(int(greedy_tokens(session.forward(tokens, 1), lm.vocab_size)[0]))
        return lm.tokenizer.decode(tokens[prompt:])
    finally:
        session.close()
        lm.gguf.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a .gguf file, or 'embedded' (the shipped SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--type", required=True, choices=sorted(TYPES), help="the new type of the 2-D tensors")
    parser.add_argument("--out", required=True, help="the output .gguf file")
    parser.add_argument("--no-check", action="store_true", help="skip loading the output on llama.cpp")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    src, out = source_path(args.src), Path(args.out)
    if out.resolve() == src.resolve():
        raise SystemExit("error: --out must differ from SRC")
    requantize(src, args.type, out, progress=not args.no_progress)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB; {src.name}: {src.stat().st_size / 1e6:.1f} MB)")
    if not args.no_check:
        print(f"llama.cpp loads it; greedy continuation of {CHECK_PROMPT!r}: {check(out)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
