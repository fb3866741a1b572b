"""A real Hugging Face model directory, built in a test: a tiny Qwen2 and a trained BPE tokenizer.

`build_hf_dir(where)` writes what a user has on disk: `config.json`, `model.safetensors`,
`generation_config.json`, and a byte-level BPE `tokenizer.json` (trained with the
`tokenizers` library on a few lines) wrapped in `PreTrainedTokenizerFast`, with a ChatML
`chat_template`, `<|endoftext|>` as pad and `<|im_end|>` as eos. No hub access.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "What is 3+4? The answer is 7.",
    "Copy the first digit: 58 -> 5",
    "Say hello. Hello!",
    "0123456789 + = ? : ; abcdefghijklmnopqrstuvwxyz",
]


def build_hf_dir(
    where: Path,
    corpus: Iterable[str] = CORPUS,
    *,
    vocab_size: int = 320,
    pad_token: str | None = "<|endoftext|>",
    model_vocab_size: int | None = None,
    seed: int = 0,
    hidden_size: int = 64,
    max_positions: int = 256,
) -> Path:
    """Save a tiny Qwen2 and its BPE tokenizer under `where`; returns `where`.

    4 attention heads: `hidden_size` 64 makes heads of 16 (vLLM's CPU attention needs 32 or
    more: `hidden_size=128`).

    `pad_token=None` leaves the tokenizer without a pad token; `model_vocab_size` smaller than
    the tokenizer's makes its special ids fall outside the model's embedding (a bad input).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from grpod.engine.model.policy import seeded, trunk_sizes

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(corpus), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token=pad_token,
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.pad_token_id
    vocab = model_vocab_size or len(tokenizer)
    if pad_id is not None and pad_id >= vocab:
        pad_id = (
            None  # the model's config cannot name it (nn.Embedding refuses); the tokenizer does
        )
    config = Qwen2Config(
        vocab_size=vocab,
        **trunk_sizes(
            hidden=hidden_size, intermediate=2 * hidden_size, layers=2, heads=4, kv_heads=2
        ),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    model = seeded(lambda: Qwen2ForCausalLM(config), seed).float()
    model.generation_config = GenerationConfig(eos_token_id=[eos_id], pad_token_id=pad_id)
    where.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(where, safe_serialization=True)
    tokenizer.save_pretrained(where)
    return where
