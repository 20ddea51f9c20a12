"""The gateway's tokenizer, without transformers or torch: a model's ``tokenizer.json`` run by the
``tokenizers`` library (the engine under transformers' fast tokenizers) and its chat template
rendered with jinja2 as transformers renders it. ``ServingTokenizer`` answers the calls the gateway
makes of a transformers tokenizer (``tokenizer(text)``, ``decode``, ``apply_chat_template``,
``get_vocab``, ``len``) with the same results, so it tokenizes as the services' tokenizers do
(``tokenizer_fingerprint`` pairs them).

A model given as anything but a directory with ``tokenizer.json`` (a hub name, a GGUF file, the
embedded default, a slow-only tokenizer) is exported once per start by a child process that loads it
with transformers (``specdec.models.load_tokenizer``) and saves it as such files: the gateway's own
process never imports either library.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# The named special tokens a template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
EXPORT_TIMEOUT_S = 600.0  # a hub download or a GGUF's tokenizer conversion, once


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the tokenizer's sorted (token, id) pairs: equal fingerprints, equal token ids."""
    digest = hashlib.sha256()
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        digest.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _template(config: dict, directory: Path) -> str | None:
    """The default chat template: ``chat_template.jinja``, else the config's (a string, or named
    templates of which "default")."""
    if (directory / TEMPLATE_FILE).is_file():
        return (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As transformers' filter: jinja's own escapes HTML characters.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


def compile_chat_template(source: str) -> jinja2.Template:
    """``source`` in the environment transformers renders chat templates in (sandboxed: templates
    from a model's files are untrusted)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ServingTokenizer:
    """A transformers-compatible tokenizer over ``tokenizers`` (the calls the gateway makes)."""

    def __init__(self, fast_tokenizer: Tokenizer, config: dict, chat_template: str | None) -> None:
        self.fast_tokenizer = fast_tokenizer
        self.chat_template = chat_template
        self.special_tokens = {name: text for name in SPECIAL_TOKEN_NAMES
                               if (text := _token_text(config.get(name))) is not None}
        # transformers skips this clean-up for BPE models (it would strip real spaces before punctuation).
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces")) and (
            type(fast_tokenizer.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
        self._compiled: jinja2.Template | None = None

    @classmethod
    def from_directory(cls, directory: str | Path) -> ServingTokenizer:
        directory = Path(directory)
        config_path = directory / CONFIG_FILE
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        return cls(Tokenizer.from_file(str(directory / TOKENIZER_FILE)), config, _template(config, directory))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.fast_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.fast_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                                  (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    def get_vocab(self) -> dict[str, int]:
        return self.fast_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.fast_tokenizer.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, conversation: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        """The conversation rendered as text (``tokenize`` must be False: callers encode the text)."""
        if tokenize:
            raise ValueError("apply_chat_template: only tokenize=False (encode the rendered text)")
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        return self._compiled.render(messages=conversation, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens)


def _export(name_or_path: str, directory: Path) -> None:
    """Save ``name_or_path``'s tokenizer as files in ``directory``, from a child process that loads it
    with transformers (this process imports neither transformers nor torch)."""
    script = ("import sys; from specdec.models import load_tokenizer; "
              "load_tokenizer(sys.argv[1]).save_pretrained(sys.argv[2])")
    done = subprocess.run([sys.executable, "-c", script, name_or_path, str(directory)], capture_output=True,
                          text=True, timeout=EXPORT_TIMEOUT_S)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise RuntimeError(f"cannot load the tokenizer of {name_or_path!r}: {lines[-1] if lines else done.returncode}")


def load_serving_tokenizer(name_or_path: str) -> ServingTokenizer:
    """The tokenizer of a model name or path, as ``specdec.models.load_tokenizer`` loads it."""
    directory = Path(name_or_path)
    if (directory / TOKENIZER_FILE).is_file():
        return ServingTokenizer.from_directory(directory)
    with tempfile.TemporaryDirectory(prefix="specdec-tokenizer-") as exported:
        _export(name_or_path, Path(exported))
        return ServingTokenizer.from_directory(exported)
