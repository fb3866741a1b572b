"""Policy loading: a Hugging Face causal LM from a local directory, or the built-in tiny Qwen2.

Weights are kept in FP32 (the master copy); `dtype = "bfloat16"` runs the trunk under bf16
autocast while the LM head, logprobs, loss and gradient accumulation stay FP32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from grpod.base.oneline import first_line
from grpod.engine.data.tokenizer import CharTokenizer, HFTokenizerAdapter
from grpod.engine.errors import EngineError

T = TypeVar("T")


def trunk_sizes(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int
) -> dict[str, int]:
    """A Qwen2 or Llama trunk's five sizes, under the names its Hugging Face config takes."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )


TINY_QWEN2 = dict(  # the W1 model (shared/bench/WORKLOADS.md)
    trunk_sizes(hidden=128, intermediate=512, layers=4, heads=4, kv_heads=2),
    tie_word_embeddings=True,
)


def seeded(build: Callable[[], T], seed: int) -> T:
    """`build()` under torch seed `seed`, the global RNG untouched: a random init that
    depends on the seed alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def build_tiny_qwen2(vocab_size: int, max_positions: int = 64, seed: int = 0, **overrides):
    """The built-in tiny Qwen2 (`overrides`: other sizes than `TINY_QWEN2`'s), FP32, random
    init under torch seed `seed` without touching the global RNG."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
        **{**TINY_QWEN2, **overrides},
    )
    return seeded(lambda: Qwen2ForCausalLM(config), seed).float()


def load_policy(name: str, chars: str, max_positions: int):
    """`(model, tokenizer)` for `name`: `tiny-qwen2` or a local HF model directory."""
    if name == "tiny-qwen2":
        tokenizer = CharTokenizer(chars)
        return build_tiny_qwen2(tokenizer.vocab_size, max(64, max_positions)), tokenizer
    path = Path(name)
    check_model_dir(path)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32, attn_implementation="sdpa"
        )
    except Exception as exc:  # transformers and safetensors raise many types for a bad file
        raise EngineError(f"model {name}: cannot load: {first_line(exc)}") from None
    return model.float(), load_tokenizer(name, chars)


def policy_skeleton(name: str, vocab_size: int) -> torch.nn.Module:
    """The policy's modules on the meta device: names, types and weight ties, no weights
    (preflight's LoRA check: a large model would make `config check` slow)."""
    with torch.device("meta"):
        if name == "tiny-qwen2":
            return build_tiny_qwen2(vocab_size)
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(name, local_files_only=True)
            return AutoModelForCausalLM.from_config(config)
        except Exception as exc:  # transformers raises many types for one bad file
            raise EngineError(f"model {name}: cannot load: {first_line(exc)}") from None


def load_tokenizer(name: str, chars: str) -> CharTokenizer | HFTokenizerAdapter:
    """The tokenizer of `name` alone (no weights): for preflight and decoding a recorded batch."""
    if name == "tiny-qwen2":
        return CharTokenizer(chars)
    from transformers import AutoTokenizer

    try:
        return HFTokenizerAdapter(AutoTokenizer.from_pretrained(name, local_files_only=True))
    except Exception as exc:  # transformers raises many types for one bad file
        raise EngineError(f"model {name}: cannot load: {first_line(exc)}") from None


def check_model_dir(path: Path) -> None:
    """A local model directory with safetensors weights, or an EngineError naming it."""
    if not path.is_dir():
        raise EngineError(f"model {path}: not 'tiny-qwen2' and not a local directory")
    if not any(path.glob("*.safetensors")):
        raise EngineError(f"model {path}: no *.safetensors weights in the directory")


def compute_context(dtype: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for the trunk when asked for, else nothing."""
    if dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def resolve_device(name: str) -> torch.device:
    """`auto` is the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise EngineError(f"device {name}: CUDA is not available on this machine")
    return torch.device(name)
