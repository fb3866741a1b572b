"""vLLM rollouts for GPU nodes (the `gpu` extra), imported only when asked for.

Before every rollout the trainer's current weights are loaded into the colocated vLLM engine,
so completions come from the policy being trained. Sampled-token logprobs are vLLM's
*processed* logprobs (after temperature and top-p): the distribution actually sampled from.
The result has the torch sampler's shape (`engine.rollout.Rollout`), so everything downstream
of the `TransportBatch` is the same whichever backend sampled.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from grpod.engine.config import EngineConfig
from grpod.engine.errors import EngineError
from grpod.engine.rollout import Rollout


class VLLMSampler:
    """A colocated `vllm.LLM` fed by token ids (no tokenizer of its own)."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        try:
            import vllm
        except ImportError:
            raise EngineError(
                "rollout_backend vllm: vllm is not installed (pip install 'grpod[gpu]')"
            ) from None
        if not torch.cuda.is_available():
            raise EngineError("rollout_backend vllm: needs a CUDA device")
        # apply_model ships a function to the engine's workers; keep them in this process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._vllm = vllm
        self._export_dir = None
        source = Path(config.model)
        if not source.is_dir():  # the built-in tiny model: export it once for vLLM to load
            self._export_dir = tempfile.TemporaryDirectory(prefix="grpod-vllm-")
            model.save_pretrained(self._export_dir.name, safe_serialization=True)
            source = Path(self._export_dir.name)
        self.llm = vllm.LLM(
            model=str(source),
            dtype="bfloat16" if config.dtype == "bfloat16" else "float32",
            seed=config.seed,
            skip_tokenizer_init=True,
            max_model_len=config.seq_len,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
        )

    def sync(self, model: torch.nn.Module) -> None:
        """Load the trainer's current weights into vLLM."""
        weights = [(name, tensor.detach()) for name, tensor in model.state_dict().items()]
        self.llm.apply_model(lambda m: m.load_weights(iter(weights)))

    def sample(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        eos_token_id: int | list[int],
        pad_token_id: int,
        seed: int,
    ) -> Rollout:
        """One completion per prompt, each request seeded from `seed` and its index."""
        vllm = self._vllm
        params = [
            vllm.SamplingParams(
                n=1,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                logprobs=0,  # the sampled token's own logprob
                stop_token_ids=[eos_token_id] if isinstance(eos_token_id, int) else eos_token_id,
                seed=(seed + i) % (1 << 63),
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        requests = [vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        ids = torch.full((len(prompts), max_new_tokens), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(prompts), max_new_tokens), dtype=torch.float32)
        mask = torch.zeros((len(prompts), max_new_tokens), dtype=torch.bool)
        for i, out in enumerate(outputs):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)[:max_new_tokens]
            if completion.logprobs is None:
                raise EngineError("rollout_backend vllm: vLLM returned no sampled logprobs")
            for t, (token, per_position) in enumerate(zip(tokens, completion.logprobs)):
                ids[i, t] = token
                logprobs[i, t] = float(per_position[token].logprob)
            mask[i, : len(tokens)] = True
        return Rollout(ids, logprobs, mask)
