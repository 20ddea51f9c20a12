"""The lean runtime's weights: a Llama-family causal LM's tensors, with the projections fused.

``LeanWeights.from_hf`` takes a loaded transformers model (Llama, SmolLM2, Mistral, Qwen2) and
fuses each layer's q/k/v projections into one [q + 2 kv, hidden] matrix and gate/up into one
[2 intermediate, hidden] matrix. The transformers model's own parameters are then pointed at
row-slices of the fused tensors, so both runtimes share one copy of the weights (the fallback and
``generate`` keep working, and memory does not double).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
# RoPE variants whose frequencies do not depend on the sequence length (dynamic / longrope do).
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def unsupported_reason(model, dtype: torch.dtype | None = None) -> str | None:
    """Why the lean runtime cannot run ``model`` (a transformers causal LM), or None if it can."""
    config = model.config
    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not a Llama-family one ({', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
    first = next(model.parameters())
    dtype = dtype or first.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {dtype}"
    if dtype != torch.float32 and first.device.type == "cpu":
        return f"dtype {dtype} on CPU (the lean runtime runs half precision on GPUs only; fp32 on CPU)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    if model_type == "llama" and getattr(config, "attention_bias", False):
        return "attention biases on a Llama config"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary embedding module"
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        return f"RoPE type {rope_type!r} (its frequencies change with the length)"
    layers = model.model.layers
    attention = layers[0].self_attn
    if getattr(attention, "o_proj").bias is not None:
        return "an output-projection bias"
    window = getattr(config, "sliding_window", None)
    context = int(getattr(config, "max_position_embeddings", None) or 1 << 30)
    windowed = getattr(config, "use_sliding_window", True) is not False or any(
        kind != "full_attention" for kind in getattr(config, "layer_types", None) or ())
    if window and windowed and int(window) < context:
        return "sliding-window attention"
    return None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q + 2 kv, hidden] (q, then k, then v)
    qkv_bias: torch.Tensor | None  # [q + 2 kv] (Qwen2)
    o: torch.Tensor  # [hidden, q]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 intermediate, hidden] (gate, then up)
    down: torch.Tensor  # [hidden, intermediate]


@dataclass
class LeanWeights:
    """Every tensor a forward reads, in the model's dtype (fp32; bf16/fp16 on GPUs), on its device."""

    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [logits width, hidden] (the embedding itself when tied)
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    inv_freq: torch.Tensor  # [head_dim / 2], fp32
    rope_scale: float  # transformers' attention_scaling (cos/sin multiplier)
    max_positions: int

    @property
    def hidden(self) -> int:
        return int(self.embed.shape[1])

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, model, share: bool = True) -> LeanWeights:
        """Fuse ``model``'s projections; with ``share`` its own parameters become views of them."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"lean runtime unsupported: {reason}")
        config = model.config
        base = model.model
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        layers = []
        with torch.no_grad():
            for layer in base.layers:
                attn, mlp = layer.self_attn, layer.mlp
                projections = (attn.q_proj, attn.k_proj, attn.v_proj)
                qkv = torch.cat([p.weight.detach() for p in projections]).contiguous()
                bias = None
                if attn.q_proj.bias is not None:
                    bias = torch.cat([p.bias.detach() for p in projections]).contiguous()
                gate_up = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]).contiguous()
                if share:
                    _share_rows(projections, qkv, bias)
                    _share_rows((mlp.gate_proj, mlp.up_proj), gate_up, None)
                layers.append(LayerWeights(
                    input_norm=layer.input_layernorm.weight.detach(),
                    qkv=qkv, qkv_bias=bias,
                    o=attn.o_proj.weight.detach().contiguous(),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    gate_up=gate_up,
                    down=mlp.down_proj.weight.detach().contiguous(),
                ))
        rotary = base.rotary_emb
        return cls(
            embed=base.embed_tokens.weight.detach(),
            layers=layers,
            final_norm=base.norm.weight.detach(),
            lm_head=model.get_output_embeddings().weight.detach().contiguous(),
            heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            intermediate=int(config.intermediate_size),
            eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            inv_freq=rotary.inv_freq.detach().float().clone(),
            rope_scale=float(getattr(rotary, "attention_scaling", 1.0)),
            max_positions=int(getattr(config, "max_position_embeddings", 1 << 30)),
        )


def _share_rows(linears, fused: torch.Tensor, fused_bias: torch.Tensor | None) -> None:
    """Point each linear's weight (and bias) at its rows of the fused tensor."""
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = fused[start : start + rows]
        if fused_bias is not None and linear.bias is not None:
            linear.bias.data = fused_bias[start : start + rows]
        start += rows
