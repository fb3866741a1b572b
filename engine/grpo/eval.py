"""Held-out evaluation: the policy's mean reward on `eval_task`, greedy or sampled.

`Evaluator(engine).run()` samples one completion for each of `eval_samples` distinct prompts
of the eval task, the first of its `seed`-shuffled order (preflight refuses more than the set
holds; the same prompts, with the same sampler seed, every time, so two evaluations differ
only by the policy) and scores them with the run's rewards. It runs under
`no_grad`, with its own generator, and reads neither the data cursor nor the optimizer: the
training run (its batches, weights and replay) is the same with evaluation on or off.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from grpod.engine.data.audit import AuditSet
from grpod.engine.data.rewardcall import NonFinite
from grpod.engine.data.rewards import RewardSet
from grpod.engine.data.tasks import config_task
from grpod.engine.data.tokenizer import encode_prompt
from grpod.engine.errors import EngineError

if TYPE_CHECKING:
    from grpod.engine.grpo.trainer import Engine


@dataclass(frozen=True)
class EvalResult:
    step: int  # the engine cursor: the evaluated policy has taken `step` steps
    samples: int
    temperature: float  # 0 = greedy
    rewards: dict[str, float]  # "total" (weighted, as trained on), each function's mean and
    # each audit reward's as "audit:NAME" (engine/data/audit.py: never trained on)
    completion_length_mean: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Evaluator:
    """Scores the current policy on the held-out task; built once, before the first step."""

    def __init__(self, engine: Engine) -> None:
        cfg = engine.config
        if not cfg.eval_task:
            raise EngineError("eval: no eval_task configured")
        self.engine = engine
        self.task = config_task(cfg, cfg.eval_task)
        self.rewards = RewardSet(  # a NaN reward makes the eval's mean NaN (rewardcall.py)
            self.task,
            cfg.rewards,
            cfg.reward_weights,
            cfg.reward_timeout_seconds,
            non_finite=NonFinite.PASS,
        )
        self.audits = AuditSet(cfg, self.task, NonFinite.PASS)  # "audit:NAME" in `rewards`
        self.prompts = self.task.prompts_for_step(0, cfg.eval_samples, cfg.seed)
        self.prompt_ids = [
            encode_prompt(
                engine.tokenizer, p.text, f"eval_task {cfg.eval_task}", cfg.prompt_format,
                cfg.system_prompt,
            )
            for p in self.prompts
        ]  # fmt: skip
        longest = max(len(ids) for ids in self.prompt_ids) + cfg.max_new_tokens
        if longest > cfg.seq_len:
            raise EngineError(
                f"eval_task {cfg.eval_task}: a prompt plus max_new_tokens is {longest} tokens, "
                f"over seq_len {cfg.seq_len}"
            )
        digest = hashlib.sha256(f"grpod-eval:{cfg.seed}".encode()).digest()
        self.seed = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    def run(self) -> EvalResult:
        cfg = self.engine.config
        started = time.perf_counter()
        out, _, texts = self.engine.sampling.generate(
            self.prompt_ids, self.seed, cfg.eval_temperature
        )
        self.engine.take_phase_seconds()  # its weight sync is the eval's time (`seconds`)
        total, parts = self.rewards.score(self.prompts, texts, 1)
        rewards = {"total": float(total.double().mean())}
        rewards.update({name: sum(v) / len(v) for name, v in parts.items()})
        audits = self.audits.rewards.score(self.prompts, texts, 1)[1] if self.audits.names else {}
        rewards.update({f"audit:{name}": sum(v) / len(v) for name, v in audits.items()})
        return EvalResult(
            step=self.engine.step,
            samples=len(texts),
            temperature=cfg.eval_temperature,
            rewards=rewards,
            completion_length_mean=float(out.mask.sum(-1).double().mean()),
            seconds=time.perf_counter() - started,
        )
