"""`EngineConfig`: the engine's typed config section (`[engine]` in grpod.toml)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from grpod.base import torchrun
from grpod.engine.errors import EngineError
from grpod.engine.kvcache import KVCacheSpec, default_sinks

# the bounds config floats share, as types (grpod.toml's example file prints them)
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]  # a share of a whole, 0..1
NonNegative = Annotated[float, Field(ge=0.0)]
Positive = Annotated[float, Field(gt=0.0)]


class ConfigSection(BaseModel):
    """A section of grpod.toml (or of one): unknown keys refused, frozen, types strict (a
    string is not coerced to a number). Every package's config section is one."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def drill_steps(description: str) -> Any:
    """A drill's field: the steps it corrupts (empty: off), `description` saying how."""
    return Field(default_factory=list, description=description)


class FaultsConfig(ConfigSection):
    """Drill faults (`[engine.faults]`): each list names the steps it corrupts; empty = off."""

    accounting: Literal["none", "last_micro_first_chunk"] = Field(
        "none",
        description="last_micro_first_chunk: a per-chunk counter, chunks in reverse (every "
        "step reads chunk 0 of its last micro)",
    )
    nan_loss_steps: list[int] = drill_steps("micro 0's loss is NaN")
    inf_grad_steps: list[int] = drill_steps("one gradient element is inf")
    sentinel_logprob_steps: list[int] = drill_steps("one sampler logprob is -9999")
    equal_reward_steps: list[int] = drill_steps("every group's rewards equal its first")
    loss_spike_steps: list[int] = drill_steps("advantages scaled by 1000")
    # rollout_backend = "vllm": the push of the trainer's weights into the sampler
    weight_sync_skip_steps: list[int] = drill_steps(
        "vllm: nothing pushed before the step's rollout"
    )
    weight_sync_stale_cache_steps: list[int] = drill_steps(
        "vllm: pushed, but the prefix cache is not reset"
    )
    weight_sync_corrupt_steps: list[int] = drill_steps(
        "vllm: the push's last untied matrix arrives shifted by one element"
    )
    weight_sync_partial_steps: list[int] = drill_steps(
        "vllm: the push leaves out its last untied matrix (the sampler keeps that tensor's "
        "previous values: one layer a step stale)"
    )
    stale_rollout_steps: list[int] = drill_steps(
        "max_staleness > 0: the step's rollout is sampled one step earlier than "
        "its bound allows (a sampler that ran ahead): it arrives too old and must be dropped "
        "(under torchrun on every rank, whatever `ranks` says: launches are collective)"
    )
    # one sample of a step poisoned: what `grpod replay --by-sample` must rank first
    poison_sample_steps: list[int] = drill_steps(
        "one sample of the step is poisoned (poison_sample_index, _kind)"
    )
    poison_sample_index: int = Field(
        0, ge=0, description="the poisoned sample's position in the step's batch (its sample id)"
    )
    poison_sample_kind: Literal["nan-logits", "logprob-shift", "loss-scale"] = Field(
        "nan-logits",
        description="nan-logits: its completion's hidden states NaN from poison_sample_layer's "
        "MLP output on; logprob-shift: its sampler logprobs 4 nats lower; loss-scale: its "
        "per-token loss x100",
    )
    poison_sample_layer: int = Field(
        1, ge=0, description="nan-logits: the decoder layer whose mlp.down_proj output is NaN"
    )
    ranks: list[int] = Field(
        default_factory=list,
        description="under torchrun: the ranks the faults fire on; empty = every rank",
    )

    @property
    def on(self) -> bool:
        return self.accounting != "none" or any(
            (
                self.nan_loss_steps,
                self.inf_grad_steps,
                self.sentinel_logprob_steps,
                self.equal_reward_steps,
                self.loss_spike_steps,
                self.stale_rollout_steps,
                self.poison_sample_steps,
                *self.weight_sync_steps,
            )
        )

    @property
    def weight_sync_steps(self) -> tuple[list[int], ...]:
        return (
            self.weight_sync_skip_steps,
            self.weight_sync_stale_cache_steps,
            self.weight_sync_corrupt_steps,
            self.weight_sync_partial_steps,
        )


class LoraConfig(ConfigSection):
    """LoRA adapters with PEFT (the `lora` extra): only they train, in FP32; rank 0 = off."""

    rank: int = Field(0, ge=0, description="adapter rank; 0 = off (full fine-tuning)")
    alpha: Positive = Field(16.0, description="scaling: the update is alpha / rank * B A")
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="> 0 draws torch's RNG: replay is then not bit-exact"
    )
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
        ],
        description="module names that get adapters (Qwen2 / Llama projections)",
    )  # fmt: skip


class EngineConfig(ConfigSection):
    """Every knob of a GRPO step. Defaults are the embedded W1 setting."""

    # model and task
    model: str = Field("tiny-qwen2", description="'tiny-qwen2' or a local model directory")
    dtype: Literal["float32", "bfloat16"] = "float32"
    task: str = Field(
        "arith",
        description="arith | copy | kv-retrieval | path to a JSONL file (copy-loophole and "
        "copy-exact: the reward-hacking drill's tasks)",
    )
    reward: str = Field("", description="module:function for a JSONL task (default: exact match)")
    rewards: list[str] = Field(
        default_factory=list,
        description="several module:function rewards (instead of reward), summed with weights",
    )
    reward_weights: list[float] = Field(
        default_factory=list, description="one weight per rewards entry; [] = all 1.0"
    )
    reward_path: str = Field(
        "", description="directory reward modules import from; grpod run records its cwd"
    )
    reward_timeout_seconds: NonNegative = Field(
        60.0, description="a reward call running longer is the reward's failure; 0 = none"
    )
    audit_rewards: list[str] = Field(
        default_factory=list,
        description="module:function rewards scored and recorded but never trained on "
        "(engine/data/audit.py): a stricter verifier, a format check; the reward_hacking guard's "
        "second opinion",
    )
    audit_every: int = Field(1, ge=1, description="score the audit rewards every N steps")
    prompt_format: Literal["raw", "chat"] = Field(
        "raw", description="raw text, or the tokenizer's chat_template with a generation prompt"
    )
    system_prompt: str = Field("", description="chat: a system message before the prompt")
    stop: list[str] = Field(
        default_factory=list, description="a completion ends after the token completing one"
    )
    long_prompt_batch_fraction: Fraction = Field(
        0.0, description="kv-retrieval: fraction of all-long-prompt batches"
    )
    kv_retrieval_records: tuple[int, int] = Field(
        (4, 48),
        strict=False,  # TOML has no tuples
        description="kv-retrieval: the range of records per prompt (inclusive)",
    )
    kv_retrieval_asked: Literal["any", "early", "late"] = Field(
        "any", description="kv-retrieval: the asked key among all, the first or the last quarter"
    )
    # rollout
    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    max_new_tokens: int = Field(4, ge=1)
    temperature: Positive = 1.0
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    rollout_backend: Literal["torch", "vllm", "vllm-server"] = Field(
        "torch",
        description="torch sampler | vllm colocated in the trainer's process | vllm-server: "
        "a vLLM OpenAI server process (started by grpod, or vllm_server_url)",
    )
    rollout_decoder: Literal["auto", "hf"] = Field(
        "auto", description="torch backend: auto = fused static-cache decoder for Qwen2/Llama"
    )
    rollout_kv_cache: Literal["dense", "lastrec", "h2o"] = Field(
        "dense",
        description="torch sampler's KV cache: dense grows with the prompt; lastrec, h2o evict",
    )
    kv_cache_length: int = Field(256, ge=1, description="lastrec/h2o: KV slots per layer")
    kv_sink_tokens: int | None = Field(
        None,
        ge=0,
        description="lastrec/h2o: first tokens never evicted; default min(16, length // 8)",
    )
    kv_grace_period: int = Field(0, ge=0, description="h2o: most recent tokens never evicted")
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=1.0, description="vllm on CUDA: the share of GPU memory vLLM may take"
    )
    vllm_kv_cache_bytes: int = Field(
        0,
        ge=0,
        description="vllm: its KV cache in bytes (0 = gpu_memory_utilization on CUDA, "
        "512 MiB on CPU, where a utilization would be a fraction of RAM)",
    )
    vllm_server_url: str = Field(
        "",
        pattern=r"^(|http://[^/\s]+:\d+|unix:/\S+)$",
        description="vllm-server: an existing server (http://host:port or unix:/socket/path, "
        "started with VLLM_SERVER_DEV_MODE=1 on this model); '' = grpod starts and stops its "
        "own, on a Unix socket in a 0700 directory",
    )
    vllm_server_api_key_env: str = Field(
        "",
        pattern=r"^(|[A-Za-z_][A-Za-z0-9_]*)$",
        description="vllm-server with vllm_server_url: the environment variable holding the "
        "server's credential, sent as a bearer token with every request (never the key here)",
    )
    vllm_server_host: str = Field(
        "127.0.0.1",
        description="no longer used (grpod's own server listens on a Unix socket): only the "
        "default is accepted",
    )
    vllm_server_port: int = Field(
        0, ge=0, le=65535, description="no longer used (see vllm_server_host): only 0"
    )
    vllm_server_python: str = Field(
        "", description="vllm-server: the interpreter that runs grpod's server; '' = grpod's own"
    )
    vllm_server_args: list[str] = Field(
        default_factory=list, description="vllm-server: more arguments for grpod's server"
    )
    vllm_server_sync_dir: str = Field(
        "",
        description="vllm-server: where weight snapshots are written for the server to load "
        "(it must see the path); '' = a new directory in /dev/shm (or the temporary directory)",
    )
    vllm_server_push: Literal["auto", "shared-memory", "snapshot"] = Field(
        "auto",
        description="vllm-server: how weights reach the server. 'shared-memory': in place, "
        "from shared regions the server maps, the parameters themselves when the sync "
        "directory is in memory (it must run on this host with grpod "
        "importable and --worker-extension-cls "
        "grpod.engine.rollout.shared_weights.SharedWeightsWorker); 'snapshot': a safetensors "
        "file it reloads; 'auto' = shared-memory for grpod's own server, snapshot for "
        "vllm_server_url",
    )
    vllm_server_cpu_malloc: Literal["retain", "glibc"] = Field(
        "retain",
        description="vllm-server on a CPU: 'retain' starts grpod's server with glibc's mmap "
        "off and its trimming off (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=4 GiB), so each "
        "push's reload reuses the memory the last one freed instead of faulting in fresh "
        "pages (W4: the push 0.43 -> 0.36 s of a 7.4 s step; the server keeps about a "
        "model's worth more memory); 'glibc': glibc's defaults. A MALLOC_* or "
        "GLIBC_TUNABLES setting in grpod's environment is passed on as it is",
    )
    vllm_server_timeout_seconds: Positive = Field(
        300.0, description="vllm-server: the longest wait for any one request's answer"
    )
    vllm_server_start_timeout_seconds: Positive = Field(
        900.0, description="vllm-server: the longest wait for grpod's server to be up"
    )
    max_staleness: int = Field(
        0,
        ge=0,
        le=8,
        description="async steps: rollouts for steps N+1..N+k are sampled while step N trains "
        "(overlapped with a vllm-server); a batch more than k weight versions old is dropped; "
        "0 = on-policy (each step samples with the weights it trains)",
    )
    weight_sync_probe_tokens: int = Field(
        0,
        ge=0,
        description="vllm: tokens of the probe vLLM continues after every weight sync, read "
        "through its prefix cache and fresh (the weight_sync guard compares them); 0 = one of "
        "vLLM's KV blocks and a token (33 on CPU, 17 on CUDA)",
    )
    weight_sync_scored_tokens: int = Field(
        16,
        ge=2,
        description="vllm: of the probe, the first tokens the trainer scores against vLLM's "
        "logprobs after every weight sync (the check's only trainer compute)",
    )
    weight_sync_on_rollout: bool = Field(
        True,
        description="vllm: an on-policy float32 step (max_staleness 0, epochs 1) compares the "
        "pushed weights on its own rollout in the training forward (its largest |vLLM - "
        "trainer| logprob, decided before the update) instead of the trainer scoring the "
        "probe; false = the probe, before any compute",
    )
    device: str = Field(
        "cpu", pattern=r"^(cpu|cuda(:\d+)?|auto)$", description="cpu | cuda[:N] | auto"
    )
    # held-out evaluation (engine/grpo/eval.py): never touches the policy or the data cursor
    eval_task: str = Field("", description="arith | copy | kv-retrieval | a JSONL file; '' = off")
    eval_every: int = Field(0, ge=0, description="evaluate every K steps; 0 = never")
    eval_samples: int = Field(16, ge=1, description="prompts per evaluation, one completion each")
    eval_temperature: NonNegative = Field(0.0, description="0 = greedy")
    eval_on_error: Literal["warn", "stop"] = Field(
        "warn", description="a failing eval reward: warn and train on, or stop the run (exit 2)"
    )
    # advantages
    scale_rewards: Literal["group", "batch", "none"] = "group"
    advantage_std: Literal["population", "sample"] = Field(
        "population", description="population (divide by n) or sample (n - 1, as TRL) std"
    )
    # packing
    seq_len: int = Field(64, ge=2)
    pack: bool = True
    micro_batch_rows: int = Field(8, ge=1)
    sequence_chunks: int = Field(1, ge=1)
    lmhead_chunks: int = Field(1, ge=1)
    chunk_order: Literal["forward", "reverse"] = "forward"
    # loss
    loss: Literal["ppo", "cispo"] = "ppo"
    eps_low: NonNegative = 0.2
    eps_high: NonNegative = 0.2
    logratio_clamp: Positive = 20.0
    tis_cap: NonNegative = Field(0.0, description="truncated importance sampling cap; 0 = off")
    kl_beta: NonNegative = 0.0
    epochs: int = Field(1, ge=1)
    # optimizer
    lr: NonNegative = 1e-3
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int = Field(1000, ge=1, description="cosine horizon")
    adam_eps: Positive = 1e-8
    adam_betas: tuple[float, float] = Field((0.9, 0.999), strict=False)  # TOML has no tuples
    weight_decay: NonNegative = 0.0
    max_grad_norm: Positive = 1.0
    # scale-out (engine/model/parallel.py)
    parallel: Literal["auto", "fsdp2", "ddp", "none"] = Field(
        "auto", description="auto = fsdp2 under torchrun (WORLD_SIZE > 1), else none"
    )
    # reproducibility and threads
    seed: int = 0
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 = leave as is")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    faults: FaultsConfig = Field(
        default_factory=FaultsConfig,
        description="drill fault injection (engine/faults.py); off by default",
    )

    @field_validator("model")
    @classmethod
    def _expand_home(cls, value: str) -> str:
        # a model in the user cache (`make model-smollm2`) is named as ~/.cache/grpod/...
        return os.path.expanduser(value) if value.startswith("~") else value

    @field_validator("group_size")
    @classmethod
    def _groups(cls, value: int) -> int:
        if value < 2:  # a group of one has zero std: every advantage 0, no learning signal
            raise ValueError("GRPO needs groups of at least 2 completions per prompt")
        return value

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.max_new_tokens + 2 > self.seq_len:
            raise ValueError(f"seq_len {self.seq_len} leaves no room for a prompt")
        if not _is_task(self.task):
            raise ValueError(f"task must be one of {sorted(BUILTIN_TASKS)} or a .jsonl path")
        self._check_kv_retrieval()
        self._check_kv_cache()
        if self.reward and self.rewards:
            raise ValueError("give reward or rewards, not both")
        bad = [w for w in self.reward_weights if not math.isfinite(w)]
        if bad:
            raise ValueError(f"reward_weights must be finite (got {bad[0]})")
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} entries, "
                f"rewards has {len(self.rewards)}"
            )
        if len(set(self.rewards)) != len(self.rewards):
            raise ValueError("rewards lists a function twice")
        if len(set(self.audit_rewards)) != len(self.audit_rewards):
            raise ValueError("audit_rewards lists a function twice")
        if self.system_prompt and self.prompt_format != "chat":
            raise ValueError("system_prompt needs prompt_format = 'chat'")
        if self.eval_every and not self.eval_task:
            raise ValueError("eval_every needs an eval_task")
        if self.eval_task and not _is_task(self.eval_task):
            raise ValueError(f"eval_task must be one of {sorted(BUILTIN_TASKS)} or a .jsonl path")
        vllm = self.rollout_backend in VLLM_BACKENDS
        if any(self.faults.weight_sync_steps) and not vllm:
            raise ValueError("faults weight_sync_*: need rollout_backend 'vllm' or 'vllm-server'")
        if self.lora.rank and vllm:
            raise ValueError(
                f"lora: the {self.rollout_backend} rollout backend does not take adapters yet"
            )
        server_fields = (
            "vllm_server_url",
            "vllm_server_python",
            "vllm_server_sync_dir",
            "vllm_server_api_key_env",
        )
        pushed_otherwise = self.vllm_server_push != "auto"
        malloc_otherwise = self.vllm_server_cpu_malloc != "retain"
        if self.rollout_backend != "vllm-server" and (
            pushed_otherwise or malloc_otherwise or any(getattr(self, f) for f in server_fields)
        ):
            raise ValueError("vllm_server_*: need rollout_backend = 'vllm-server'")
        if self.vllm_server_host != "127.0.0.1" or self.vllm_server_port:
            raise ValueError(
                "vllm_server_host, vllm_server_port: grpod's own server listens on a Unix "
                "socket that only this user can reach (docs/SECURITY.md); a TCP server is one "
                "you start, named by vllm_server_url"
            )
        if self.vllm_server_api_key_env and not self.vllm_server_url:
            raise ValueError(
                "vllm_server_api_key_env: for a server named by vllm_server_url (grpod's own "
                "is reached on its private Unix socket)"
            )
        if "" in self.stop:
            raise ValueError("stop strings must not be empty")
        self._check_staleness()
        return self

    @property
    def vllm_server_push_in_place(self) -> bool:
        """Whether pushes reach the server through shared memory (`vllm_server_push`;
        'auto': for grpod's own server, which it starts with the worker extension)."""
        if self.vllm_server_push == "auto":
            return not self.vllm_server_url
        return self.vllm_server_push == "shared-memory"

    def _check_staleness(self) -> None:
        if self.max_staleness == 0:
            if self.faults.stale_rollout_steps:
                raise ValueError("faults stale_rollout_steps: needs max_staleness > 0")
            return
        if self.tis_cap <= 0:
            raise ValueError(
                f"max_staleness = {self.max_staleness} trains on batches sampled by older "
                "weights: it needs importance correction (tis_cap > 0)"
            )
        if self.epochs > 1:
            raise ValueError("max_staleness > 0 with epochs > 1 is not supported")

    def _check_kv_retrieval(self) -> None:
        low, high = self.kv_retrieval_records
        if not 1 <= low <= high <= MAX_KV_RECORDS:
            raise ValueError(
                f"kv_retrieval_records {list(self.kv_retrieval_records)}: need "
                f"1 <= low <= high <= {MAX_KV_RECORDS} (distinct two-letter keys)"
            )
        longest = kv_retrieval_prompt_tokens(high)
        tiny = self.task == "kv-retrieval" and self.model == "tiny-qwen2"  # character tokens
        if tiny and longest + self.max_new_tokens > self.seq_len:
            raise ValueError(
                f"kv_retrieval_records up to {high} make prompts of {longest} tokens: "
                f"seq_len {self.seq_len} leaves no room for {self.max_new_tokens} new tokens"
            )

    def _check_kv_cache(self) -> None:
        policy = self.rollout_kv_cache
        if policy == "dense":
            return
        if self.rollout_backend != "torch" or self.rollout_decoder != "auto":
            raise ValueError(
                f"rollout_kv_cache = {policy!r} runs in the torch sampler's fused decoder: "
                f"needs rollout_backend = 'torch' and rollout_decoder = 'auto'"
            )
        if policy != "h2o" and self.kv_grace_period:
            raise ValueError(f"kv_grace_period is an h2o setting; rollout_kv_cache is {policy!r}")
        sinks = self._kv_sinks()
        if self.kv_cache_length <= sinks + self.kv_grace_period:
            raise ValueError(
                f"kv_cache_length {self.kv_cache_length} must exceed the protected tokens "
                f"(kv_sink_tokens {sinks} + kv_grace_period {self.kv_grace_period})"
            )
        if policy == "h2o" and self.tis_cap <= 0:
            raise ValueError(
                "rollout_kv_cache = 'h2o' samples through per-head evictions the trainer "
                "cannot rebuild: it trains with full attention and needs tis_cap > 0"
            )

    @property
    def kv_cache_spec(self) -> KVCacheSpec | None:
        """The bounded rollout cache in force, or None for the dense cache."""
        if self.rollout_kv_cache == "dense":
            return None
        return KVCacheSpec(
            self.rollout_kv_cache, self.kv_cache_length, self._kv_sinks(), self.kv_grace_period
        )

    def _kv_sinks(self) -> int:
        """`kv_sink_tokens`, or its default for the cache length (an explicit 0 stays 0)."""
        sinks = self.kv_sink_tokens
        return default_sinks(self.kv_cache_length) if sinks is None else sinks

    def digest(self) -> str:
        """sha256 of the canonical JSON of this config (recorded in every batch)."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


BUILTIN_TASKS = frozenset({"arith", "copy", "kv-retrieval", "copy-loophole", "copy-exact"})
MAX_KV_RECORDS = 26 * 26  # kv-retrieval's keys are distinct two-letter strings


def kv_retrieval_prompt_tokens(records: int) -> int:
    """Character tokens of a kv-retrieval prompt: `<bos>`, `ab:3;` per record, `?ab=`."""
    return 1 + 5 * records + 4


def _is_task(name: str) -> bool:
    return name.endswith(".jsonl") or name in BUILTIN_TASKS


def check_parallel(
    config: EngineConfig, world: int | None = None, per_node: int | None = None
) -> str:
    """The parallel mode of `config` over `world` ranks, `per_node` of them on each node
    (default: `WORLD_SIZE`, `LOCAL_WORLD_SIZE`); EngineError for what a sharded run refuses,
    as preflight checks it before anything is created."""
    if world is None:
        world, per_node = torchrun.world_size(), torchrun.local_world_size()
    per_node = world if per_node is None else per_node
    mode = config.parallel if config.parallel != "auto" else ("fsdp2" if world > 1 else "none")
    if world == 1 and not torchrun.launched():
        # one process outside torchrun (`grpod replay --rank R`, a one-process resume of a
        # torchrun run): nothing to shard or replicate, and no process group to join
        mode = "none"
    if config.rollout_backend == "vllm-server" and world > 1:
        if mode == "none":
            raise EngineError(
                "engine.rollout_backend: vllm-server under torchrun serves a node of one "
                "data-parallel job (parallel = 'fsdp2' or 'ddp'), not independent replicas"
            )
        if config.vllm_server_url and world > per_node:
            raise EngineError(
                "engine.vllm_server_url: one server per node, and this job spans nodes "
                "(each node's local rank 0 would push into the one named; leave it empty)"
            )
    if mode == "none":
        return mode
    if config.prompts_per_step % world:
        raise EngineError(
            f"engine.prompts_per_step: {config.prompts_per_step} groups do not split "
            f"evenly over {world} ranks"
        )
    return mode


# the rollout backends that push the trainer's weights and check them (engine/weight_sync.py)
VLLM_BACKENDS = frozenset({"vllm", "vllm-server"})
