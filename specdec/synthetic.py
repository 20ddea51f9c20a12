"""Synthetic targets: Llama models of real sizes with seeded random weights, built in memory.

Benchmarks at controlled acceptance (the replay drafter, ``specdec.replay``) measure the system,
not the draft, so the target's weights do not matter, only its shape and dtype: these targets cost
what a real model of that size costs per step and need no download. Names:

    synthetic:llama-1b                   Llama 3.2 1B's shape
    synthetic:llama-8b                   Llama 3.1 8B's shape
    synthetic:llama-1b:layers=4,seed=3   a preset with fields overridden
    synthetic:llama:hidden=2048,layers=16,heads=32,kv_heads=8,intermediate=8192   a custom shape

Fields: hidden, layers, heads, kv_heads (default heads), intermediate, vocab (default the
tokenizer's size), context (max positions, default 4096), seed (default 0), std (init, default 0.02).
The tokenizer is the embedded model's (SmolLM2's, 49 152 ids; ``specdec.models`` supplies it), so the
gateway tokenizes prompts as usual and the vocabulary is 49 152, not Llama's 128 256: the presets
have about 1.17 B and 7.4 B parameters. Embeddings are not tied (with random weights a tied head
scores the input token far above all others and the model repeats it forever).

Weights are uniform with the given std (uniform draws are twice as fast as normal ones on a CPU;
a 1 B fp32 model builds in seconds), drawn from a generator seeded per tensor on the model's device:
every process building the same name on the same device type gets the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from specdec.lm import ModelLoadError

SYNTHETIC_PREFIX = "synthetic:"
CUSTOM_SHAPE = "llama"
# Llama 3.2 1B and Llama 3.1 8B (their config.json), less the vocabulary: the tokenizer decides it.
PRESETS = {
    "llama-1b": {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate": 8192},
    "llama-8b": {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "intermediate": 14336},
}
ROPE_THETA = 500000.0  # Llama 3's
RMS_NORM_EPS = 1e-5
# Random draws go through a buffer of this many values, so a bf16 or fp16 model never holds a
# second, fp32 copy of a whole weight matrix.
INIT_CHUNK = 1 << 24


@dataclass(frozen=True)
class SyntheticSpec:
    """A parsed ``synthetic:`` name."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int | None = None  # None: the tokenizer's size
    context: int = 4096
    seed: int = 0
    std: float = 0.02

    def config(self, vocab_size: int, bos_token_id=None, eos_token_id=None, pad_token_id=None):
        """The transformers ``LlamaConfig`` of this shape over ``vocab_size`` ids."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.context, rope_theta=ROPE_THETA, rms_norm_eps=RMS_NORM_EPS,
            initializer_range=self.std, tie_word_embeddings=False, bos_token_id=bos_token_id,
            eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        )

    def parameter_count(self, vocab_size: int) -> int:
        """Parameters of the model over ``vocab_size`` ids (embedding and head untied)."""
        head_dim = self.hidden // self.heads
        attention = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + mlp + 2 * self.hidden) + 2 * vocab_size * self.hidden + self.hidden


def is_synthetic(name: str) -> bool:
    return str(name).startswith(SYNTHETIC_PREFIX)


def _positive_int(name: str, field: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ModelLoadError(f"{name}: {field}={text!r} must be a positive integer")
    return value


def parse_synthetic(name: str) -> SyntheticSpec:
    """The spec of a ``synthetic:`` name; ``ModelLoadError`` naming the field that is wrong."""
    if not is_synthetic(name):
        raise ModelLoadError(f"{name!r} is not a synthetic model name (they start with {SYNTHETIC_PREFIX!r})")
    shape, _, overrides = name[len(SYNTHETIC_PREFIX):].partition(":")
    if shape not in PRESETS and shape != CUSTOM_SHAPE:
        raise ModelLoadError(f"{name}: unknown shape {shape!r} (choose from {', '.join([*PRESETS, CUSTOM_SHAPE])}; "
                             f"{CUSTOM_SHAPE} takes hidden=,layers=,heads=,intermediate=)")
    values: dict = dict(PRESETS.get(shape, {}))
    known = {f.name for f in fields(SyntheticSpec)} - {"name"}
    for item in [part.strip() for part in overrides.split(",") if part.strip()]:
        field, sep, text = item.partition("=")
        field = field.strip()
        if not sep or field not in known:
            raise ModelLoadError(f"{name}: {item!r} is not FIELD=VALUE with FIELD one of {', '.join(sorted(known))}")
        if field == "std":
            try:
                values[field] = float(text)
            except ValueError:
                values[field] = math.nan
            if not (math.isfinite(values[field]) and values[field] > 0):
                raise ModelLoadError(f"{name}: std={text!r} must be a positive number")
        elif field == "seed":
            try:
                values[field] = int(text)
            except ValueError:
                raise ModelLoadError(f"{name}: seed={text!r} must be an integer") from None
        else:
            values[field] = _positive_int(name, field, text)
    missing = [f for f in ("hidden", "layers", "heads", "intermediate") if f not in values]
    if missing:
        raise ModelLoadError(f"{name}: the {CUSTOM_SHAPE} shape needs {', '.join(f + '=' for f in missing)}")
    values.setdefault("kv_heads", values["heads"])
    spec = SyntheticSpec(name=name, **values)
    if spec.hidden % spec.heads:
        raise ModelLoadError(f"{name}: hidden={spec.hidden} must be a multiple of heads={spec.heads}")
    if spec.heads % spec.kv_heads:
        raise ModelLoadError(f"{name}: heads={spec.heads} must be a multiple of kv_heads={spec.kv_heads}")
    if (spec.hidden // spec.heads) % 2:
        raise ModelLoadError(f"{name}: the head size hidden/heads={spec.hidden // spec.heads} must be even (RoPE)")
    return spec


def _fill_uniform(tensor: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Fill ``tensor`` with U(-a, a) of standard deviation ``std``, in fp32 chunks."""
    bound = std * math.sqrt(3.0)
    flat = tensor.view(-1)
    if tensor.dtype == torch.float32:
        flat.uniform_(-bound, bound, generator=generator)
        return
    buffer = torch.empty(min(INIT_CHUNK, flat.numel()), dtype=torch.float32, device=tensor.device)
    for start in range(0, flat.numel(), INIT_CHUNK):
        part = buffer[: min(INIT_CHUNK, flat.numel() - start)]
        part.uniform_(-bound, bound, generator=generator)
        flat[start : start + part.numel()].copy_(part)


@torch.no_grad()
def build_synthetic_model(spec: SyntheticSpec, tokenizer, dtype: torch.dtype, device: torch.device):
    """A ``LlamaForCausalLM`` of ``spec``'s shape for ``tokenizer``, seeded random weights in ``dtype``
    on ``device``, in eval mode. Built on the meta device first, so no memory is spent on an
    initialisation that would be overwritten."""
    from transformers import LlamaForCausalLM

    vocab = spec.vocab or len(tokenizer)
    if vocab < len(tokenizer):
        raise ModelLoadError(f"{spec.name}: vocab={vocab} is below the tokenizer's {len(tokenizer)} ids "
                             "(prompts would hold ids the model has no embedding for)")
    config = spec.config(vocab, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    for index, (name, param) in enumerate(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.fill_(1.0)  # RMSNorm gains, as transformers initialises them
            continue
        generator = torch.Generator(device=device).manual_seed(spec.seed * 1_000_003 + index)
        _fill_uniform(param, spec.std, generator)
    # Non-persistent buffers (RoPE's inverse frequencies) hold garbage after to_empty: rebuild them.
    with device:
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    unexpected = [name for name, _ in model.named_buffers() if not name.startswith("model.rotary_emb.")]
    if unexpected:
        raise ModelLoadError(f"{spec.name}: buffers this builder does not initialise: {', '.join(unexpected)}")
    model.config.dtype = dtype
    return model.eval()

