"""Tiny random causal LMs and a tiny tokenizer, built in-test (nothing is downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Where the tests' models run: cpu by default (CI); e.g. SPECDEC_TEST_DEVICE=cuda reruns the exactness
# tests on a GPU, whose kernels differ from the CPU's.
TEST_DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "def add(a, b):\n    return a + b\n",
    "speculative decoding drafts tokens and the target verifies them in one pass",
    "exactness is sacred: greedy outputs are token identical",
    "for i in range(10):\n    print(i * i)\n",
    "Hello! How can I help you today? I am a small assistant.",
    "numbers 0 1 2 3 4 5 6 7 8 9 and letters a b c d e f g",
    "ünïcödé bytes: 日本語のテキスト, emoji 🎉 and accents é à ç",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(directory: Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def build_model(
    directory: Path,
    tokenizer_dir: Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    seed: int = 0,
    vocab_size: int | None = None,
    init_std: float = 0.25,
) -> Path:
    """A random Llama saved as safetensors beside a copy of the tokenizer.

    A large init std makes the distributions peaked, so greedy ties are rare and drafts are
    sometimes accepted and often rejected.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def build_pair(root: Path) -> tuple[Path, Path, Path]:
    """(tokenizer dir, target dir, draft dir) under ``root``; reuses a pair already built there."""
    tok_dir, target_dir, draft_dir = root / "tokenizer", root / "target", root / "draft"
    if not (draft_dir / "config.json").exists():
        build_tokenizer(tok_dir)
        build_model(target_dir, tok_dir, hidden_size=64, layers=2, seed=0)
        build_model(draft_dir, tok_dir, hidden_size=32, layers=1, seed=1)
    return tok_dir, target_dir, draft_dir


def build_noisy_copy(directory: Path, source_dir: Path, *, noise_std: float = 0.01, seed: int = 2) -> Path:
    """The model at ``source_dir`` with gaussian noise (``noise_std`` times each tensor's own std)
    added to every weight: a draft close to the target that agrees often but not always, so
    blocks are partially accepted and rolled back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (directory / "config.json").exists():
        return directory
    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            scale = float(param.std()) if param.numel() > 1 else 0.0
            if scale > 0:
                param.add_(torch.randn(param.shape, generator=generator) * scale * noise_std)
    model.save_pretrained(directory, safe_serialization=True)
    AutoTokenizer.from_pretrained(source_dir).save_pretrained(directory)
    return directory


def build_eagle_head(directory: Path, target_dir: Path, prompts: list[list[int]], *, new_tokens: int = 48,
                     steps: int = 20, seed: int = 0) -> Path:
    """An EAGLE head for the tiny target at ``target_dir``, trained briefly on the target's own greedy
    continuations of ``prompts`` (teacher-forced features). A random tiny target's text has nothing to
    generalise from, so the head learns those continuations: on them its drafts are mostly accepted
    and sometimes not (rounds accept, reject and roll back); elsewhere they mostly fail."""
    from specdec.eagle import train as eagle_train
    from specdec.eagle.features import teacher_force
    from specdec.eagle.head import EagleHead
    from specdec.models import load_model

    if (directory / "config.json").exists():
        return directory
    target = load_model(str(target_dir), device="cpu", runtime="hf")
    sequences = []
    for prompt in prompts:
        out = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
        sequences.append(out[0].tolist())
    records = [{"answer_start": len(p), **f} for p, f in zip(prompts, teacher_force(target, sequences, token_budget=1024))]
    torch.manual_seed(seed)
    head = EagleHead.from_target(target, list(range(target.vocab_size)))
    head.calibrate(torch.cat([r["features"] for r in records]))
    position_of = torch.arange(target.vocab_size)
    batch = eagle_train.collate(records)
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-3)
    for _ in range(steps):
        loss, _ = eagle_train.batch_loss(head, batch, position_of, depth=3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.save(directory)
