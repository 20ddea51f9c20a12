"""A loaded causal LM (``LoadedModel``): KV-cached forwards, vocabulary facts, the FR-Spec head.

The loader (``specdec.models``) builds it; KV sessions (``specdec.kv``) and batched passes
(``specdec.ragged``) run it. It imports none of them, so the dependencies point one way:
``lm`` <- ``kv`` <- ``ragged`` <- ``models`` (the loader switches the attention to the ragged one).
Where the loader built the lean runtime (``specdec.lean``, Llama-family models), caches are
``LeanKV``s and forwards run ``LeanModel.forward``; transformers' model stays beside it (same
weights) for ``generate`` and as the ``--runtime hf`` fallback. On the gguf runtime
(``specdec.gguf``: a GGUF file on llama.cpp's kernels) there is no torch model at all: caches are
``GgufKV``s and forwards run ``GgufModel.forward``, the same contract as the lean runtime's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from specdec.gguf.runtime import GgufKV, GgufModel
from specdec.lean.kv import LeanKV
from specdec.tokenizer import tokenizer_fingerprint
from specdec.wire_types import FieldError

# FR-Spec: a draft directory may restrict its LM head to these token ids (a JSON list). The draft then
# never proposes other ids (q = 0 there), which exact acceptance handles; the head costs a fraction.
HEAD_TOKEN_IDS_FILE = "head_token_ids.json"
# The caches of the runtimes whose forward packs several sessions into one pass (``packed_runtime``).
PACKED_CACHES = (LeanKV, GgufKV)


class ModelLoadError(RuntimeError):
    """A model could not be found, loaded, or paired with another."""


@dataclass
class LoadedModel:
    """A causal LM ready for KV-cached forwards, with its tokenizer and vocabulary facts."""

    name: str
    model: torch.nn.Module | None  # None on the gguf runtime (no torch weights)
    tokenizer: object
    device: torch.device
    vocab_size: int  # ids the tokenizer knows; ids at or beyond it are never emitted
    eos_token_ids: tuple[int, ...]
    _cache_kwarg: str = field(default="cache", repr=False)
    ragged_attention: bool = False  # batched passes over several sessions' caches (specdec.ragged)
    head_token_ids: torch.Tensor | None = field(default=None, repr=False)  # FR-Spec reduced head
    _head_weight: torch.Tensor | None = field(default=None, repr=False)
    lean: object | None = field(default=None, repr=False)  # specdec.lean.LeanModel when runtime == "lean"
    gguf: GgufModel | None = field(default=None, repr=False)  # when runtime == "gguf" (then model is None)

    @property
    def runtime(self) -> str:
        return "gguf" if self.gguf is not None else "hf" if self.lean is None else "lean"

    @property
    def packed_runtime(self):
        """The runtime whose ``forward(caches, feeds, num_logits)`` packs several sessions into one
        pass (``LeanModel`` or ``GgufModel``), or None on transformers' forward."""
        return self.gguf if self.gguf is not None else self.lean

    def restrict_lm_head(self, token_ids: list[int]) -> None:
        """Compute logits only for ``token_ids``; every other id gets -inf (probability 0)."""
        if self.gguf is not None:
            raise ModelLoadError(f"{self.name}: a reduced LM head ({HEAD_TOKEN_IDS_FILE}) is not supported on "
                                 "the gguf runtime")
        ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
        if len(ids) == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.logits_width:
            raise ModelLoadError(f"{self.name}: {HEAD_TOKEN_IDS_FILE} holds ids outside 0..{self.logits_width - 1}")
        weight = self.model.get_output_embeddings().weight
        self.head_token_ids = ids.to(self.device)
        self._head_weight = weight.detach()[self.head_token_ids].contiguous()
        if self.lean is not None:
            self.lean.restrict_lm_head(self.head_token_ids)

    def capture_graphs(self) -> int:
        """On the lean runtime with CUDA graphs: capture every pass bucket now (service warm-up);
        how many. 0 elsewhere."""
        static = getattr(self.lean, "static", None)
        return static.capture_all() if static is not None else 0

    @functools.cached_property
    def fingerprint(self) -> str:
        """``tokenizer_fingerprint`` of this model's tokenizer (hashing the whole vocabulary is slow: once per model)."""
        return tokenizer_fingerprint(self.tokenizer)

    @property
    def logits_width(self) -> int:
        if self.gguf is not None:
            return self.gguf.vocab_size
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_positions(self) -> int:
        if self.gguf is not None:
            return self.gguf.max_positions
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def validate_prompt(self, prompt_ids: list[int], field: str = "prompt_token_ids") -> None:
        """``FieldError`` naming ``field`` unless the ids fit this model's vocabulary and context."""
        if not prompt_ids:
            raise FieldError(field, "must not be empty")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise FieldError(field, f"id {bad} is outside the vocabulary (size {self.vocab_size})")
        if len(prompt_ids) >= self.max_positions:
            raise FieldError(field, f"{len(prompt_ids)} tokens exceed the model context ({self.max_positions})")

    def new_cache(self):
        """An empty KV cache: a ``LeanKV`` (``GgufKV``) on the lean (gguf) runtime, transformers'
        ``DynamicCache`` otherwise."""
        if self.packed_runtime is not None:
            return self.packed_runtime.new_kv()
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers
            return DynamicCache()

    @property
    def feature_size(self) -> int:
        """Width of the features ``captured_features`` yields (the hidden size); 0 if it cannot."""
        if self.gguf is not None:
            return 0
        if self.lean is None and not isinstance(getattr(self.model.base_model, "norm", None), torch.nn.Module):
            return 0
        return int(self.model.config.hidden_size)

    @contextlib.contextmanager
    def captured_features(self) -> Iterator[list[torch.Tensor]]:
        """Within: each forward pass appends the target's features of every token it fed (the final
        norm's input, packed as fed: [tokens, H], fp32, CPU) to the yielded list. Passes must not run
        concurrently on this model while it is open (the verifier runs one pass at a time)."""
        passes: list[torch.Tensor] = []
        if self.lean is not None:
            if self.lean.feature_sink is not None:
                raise RuntimeError("features are already being captured on this model")
            self.lean.feature_sink = passes.append
            try:
                yield passes
            finally:
                self.lean.feature_sink = None
            return
        if not self.feature_size:
            raise ValueError(f"{self.name}: no final norm to take features from")

        def take(module, args) -> None:
            passes.append(args[0].reshape(-1, args[0].shape[-1]).float().cpu())

        handle = self.model.base_model.norm.register_forward_pre_hook(take)
        try:
            yield passes
        finally:
            handle.remove()

    @torch.inference_mode()
    def forward(self, input_ids: list[int], cache, num_logits: int, on_device: bool = False) -> torch.Tensor:
        """Feed ``input_ids`` after what ``cache`` holds; return fp32 logits [num_logits, V], on the
        host or (``on_device``) where the model runs."""
        if isinstance(cache, PACKED_CACHES):
            return logits_to(self.packed_runtime.forward([cache], [input_ids], [num_logits]), on_device)
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        return self.forward_rows(ids, cache, num_logits, on_device=on_device)[0]

    @torch.inference_mode()
    def forward_rows(self, ids: torch.Tensor, cache, keep: int | torch.Tensor, position_ids: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None, on_device: bool = False) -> torch.Tensor:
        """One forward over ``ids`` [B, N] after ``cache``; fp32 logits [B, keep, V] of the last
        ``keep`` columns, or [B, len(keep), V] of the columns a 1-D index tensor ``keep`` names, on the
        host or (``on_device``) where the model runs. Batched passes give per-row ``position_ids``
        and a 4D mask (which makes transformers skip building its own)."""
        kwargs = {self._cache_kwarg: cache, "use_cache": True}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        columns = slice(-keep, None) if isinstance(keep, int) else keep
        if self.head_token_ids is not None:
            hidden = self.model.base_model(input_ids=ids, **kwargs).last_hidden_state[:, columns]
            reduced = hidden @ self._head_weight.T
            logits = torch.full((*reduced.shape[:2], self.logits_width), -torch.inf, device=self.device)
            logits[..., self.head_token_ids] = reduced.float()
            return logits_to(logits, on_device)
        logits = self.model(input_ids=ids, logits_to_keep=keep, **kwargs).logits
        return logits_to((logits[:, -keep:] if isinstance(keep, int) else logits).float(), on_device)


def logits_to(logits: torch.Tensor, on_device: bool) -> torch.Tensor:
    """A pass's logits where its caller decides: left on the model's device (the verifier and the
    drafter pick tokens there and read back only those), or copied to the host."""
    return logits if on_device else logits.cpu()



def keep_torch_to_one_thread(lm: LoadedModel) -> None:
    """On the gguf runtime llama.cpp's threads run the passes and torch only picks tokens (an argmax
    or a softmax over a row): one torch thread, so that its pool never wakes beside llama.cpp's
    threads. Call it on the model thread (OpenMP keeps the count per thread)."""
    if lm.gguf is not None:
        torch.set_num_threads(1)


def model_threads(lm: LoadedModel | None) -> int:
    """CPU threads a service's model passes run on: llama.cpp's on the gguf runtime, else torch's
    (``serve --threads``; torch's default). Call it on the model thread."""
    gguf = lm.gguf if lm is not None else None
    return gguf.context.threads if gguf is not None else torch.get_num_threads()
