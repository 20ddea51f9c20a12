"""What an EAGLE drafter needs of its target, read without loading the target.

The head reads two of the target's tensors: the input embedding (it embeds every token it feeds) and
the LM head's rows for its ids (unless it trained its own); the drafter service also needs the
target's vocabulary facts (tokenizer, vocabulary size, context length, end-of-sequence ids) to check
and describe sessions. ``load_model`` would hold every layer of the target in the drafter for that.
``read_target`` instead reads those two tensors by name from the target's safetensors
(``safetensors.safe_open``: nothing else is read) and builds the model's module tree on the meta
device (config and shapes, no memory) for the facts. The target is found as ``load_model`` finds it
(``resolve_model_path``: a directory, a hub id, the embedded default's cached safetensors directory);
the tensors take the dtype and device ``load_model`` would give them, so drafts are unchanged.
A synthetic target has no files (its weights are generated), so it is built whole.
"""

from __future__ import annotations

import json
import logging

import torch

from specdec.eagle.head import TargetTensors
from specdec.lm import LoadedModel, ModelLoadError
from specdec.models import as_loaded_model, default_device, default_dtype, load_model, resolve_model_path
from specdec.synthetic import is_synthetic

log = logging.getLogger("specdec.eagle")

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"


def read_target(name_or_path: str, device: str | torch.device | None = None) -> tuple[LoadedModel, TargetTensors]:
    """The target's facts (a ``LoadedModel`` whose modules are on the meta device: it cannot run a
    forward) and the tensors a head reads, loaded on ``device``."""
    if is_synthetic(name_or_path):
        target = load_model(name_or_path, device=device, runtime="hf")
        return target, TargetTensors.of(target)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    device = torch.device(device) if device is not None else default_device()
    dtype = default_dtype(device)
    try:
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {name_or_path!r}: {exc}") from exc
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config).eval()
    facts = as_loaded_model(name_or_path, path, skeleton, tokenizer, device)
    files = _tensor_files(path, name_or_path)
    embedding_weight = skeleton.get_input_embeddings().weight
    output_weight = skeleton.get_output_embeddings().weight
    embedding = _read(files, _names_of(skeleton, embedding_weight), name_or_path).to(device, dtype)
    if output_weight is embedding_weight:  # tied: the LM head is the embedding

        def lm_head_rows(ids: torch.Tensor) -> torch.Tensor:
            return embedding[ids]
    else:
        output_names = _names_of(skeleton, output_weight)

        def lm_head_rows(ids: torch.Tensor) -> torch.Tensor:  # read when asked (once, at head load)
            return _read(files, output_names, name_or_path)[ids.cpu()].to(device, dtype)

    return facts, TargetTensors(skeleton, facts.vocab_size, embedding, lm_head_rows)


def _names_of(model: torch.nn.Module, weight: torch.Tensor) -> list[str]:
    """Every name ``weight`` has in ``model`` (a tied weight has several)."""
    return [name for name, param in model.named_parameters(remove_duplicate=False) if param is weight]


def _tensor_files(path: str, name: str) -> dict[str, str]:
    """Which safetensors file holds each tensor of the checkpoint at ``path`` (a directory or hub id)."""
    from transformers.utils import cached_file

    single = cached_file(path, SAFETENSORS_FILE, _raise_exceptions_for_missing_entries=False)
    if single is not None:
        from safetensors import safe_open

        with safe_open(single, "pt") as f:
            return {key: single for key in f.keys()}
    index = cached_file(path, SAFETENSORS_INDEX_FILE, _raise_exceptions_for_missing_entries=False)
    if index is None:
        raise ModelLoadError(f"cannot load model {name!r}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX_FILE}")
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    shards = {shard: cached_file(path, shard) for shard in set(weight_map.values())}
    return {key: shards[shard] for key, shard in weight_map.items()}


def _read(files: dict[str, str], names: list[str], model: str) -> torch.Tensor:
    """The first of ``names`` the checkpoint holds, read alone from its file."""
    from safetensors import safe_open

    name = next((n for n in names if n in files), None)
    if name is None:
        raise ModelLoadError(f"cannot load model {model!r}: its checkpoint has no tensor {' or '.join(names)}")
    log.debug("reading %s of %s", name, model)
    with safe_open(files[name], "pt") as f:
        return f.get_tensor(name)
