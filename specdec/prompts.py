"""Turning a request's input (plain text, chat messages or token ids) into prompt token ids."""

from __future__ import annotations

from collections.abc import Sequence

from specdec.wire_types import FieldError


def encode_text(tokenizer, text: str) -> list[int]:
    """Plain text, no template (special tokens as the tokenizer adds them by default)."""
    return list(tokenizer(text)["input_ids"])


def encode_chat(tokenizer, messages: Sequence[tuple[str, str]]) -> list[int]:
    """Render ``(role, content)`` messages with the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise FieldError("messages", "the target's tokenizer has no chat template")
    rendered = tokenizer.apply_chat_template(
        [{"role": role, "content": content} for role, content in messages],
        tokenize=False,
        add_generation_prompt=True,
    )
    # The template already holds the special tokens it needs.
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
