"""The gateway's tokenizer (``specdec.tokenizer``: ``tokenizers`` + jinja2, no transformers) against
transformers' on the same files: the same ids for text and chat, the same decoded text, the same
vocabulary (so the same fingerprint the services report)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from specdec.prompts import encode_chat, encode_text
from specdec.tokenizer import ServingTokenizer, tokenizer_fingerprint
from tests.tiny_models import CORPUS

TEXTS = [*CORPUS, "", " leading space", "tabs\tand\nnewlines", "<|im_start|>special in text<|im_end|>", "日本語 🎉"]
CHATS = [
    [("user", "hi")],
    [("system", "be brief"), ("user", "the quick brown fox"), ("assistant", "jumps"), ("user", "again?")],
    [("user", "ünïcödé and <|im_end|> inside")],
]


@pytest.fixture(scope="module")
def both(tiny_pair):
    return ServingTokenizer.from_directory(tiny_pair[1]), AutoTokenizer.from_pretrained(tiny_pair[1])


def test_text_encodes_and_decodes_as_transformers_does(both):
    ours, theirs = both
    for text in TEXTS:
        ids = encode_text(ours, text)
        assert ids == encode_text(theirs, text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.decode([3, 4, 5, 300]) == theirs.decode([3, 4, 5, 300])


def test_chat_renders_as_transformers_does(both):
    ours, theirs = both
    assert ours.chat_template == theirs.chat_template
    for chat in CHATS:
        assert encode_chat(ours, chat) == encode_chat(theirs, chat), chat


def test_the_vocabulary_and_fingerprint_match(both):
    ours, theirs = both
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert tokenizer_fingerprint(ours) == tokenizer_fingerprint(theirs)


def test_a_template_that_raises_names_the_messages(both, tmp_path):
    ours, _ = both
    ours = ServingTokenizer(ours.fast_tokenizer, {"eos_token": "<|im_end|>"},
                            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
                            "{{ eos_token }}{{ messages | tojson }}")
    assert ours.apply_chat_template([{"role": "user", "content": "é<"}]) == '<|im_end|>[{"role": "user", "content": "é<"}]'
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="first must be user"):
        ours.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        ServingTokenizer(ours.fast_tokenizer, {}, None).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.embedded
def test_the_embedded_target_s_tokenizer_through_the_export(tmp_path):
    """The embedded default ships as a GGUF: the gateway's tokenizer comes from files a child process
    exports with transformers, and tokenizes and renders SmolLM2's own template as transformers does."""
    from specdec.models import load_tokenizer
    from specdec.tokenizer import load_serving_tokenizer

    ours, theirs = load_serving_tokenizer("embedded"), load_tokenizer("embedded")
    assert tokenizer_fingerprint(ours) == tokenizer_fingerprint(theirs) and len(ours) == len(theirs)
    for text in TEXTS:
        ids = encode_text(ours, text)
        assert ids == encode_text(theirs, text) and ours.decode(ids, True) == theirs.decode(ids, True), text
    for chat in CHATS:
        assert encode_chat(ours, chat) == encode_chat(theirs, chat), chat
