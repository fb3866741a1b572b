"""`GuardsConfig`: the guards' typed config section (`[guards]` in grpod.toml), one per guard."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, model_validator

from grpod.engine.config import ConfigSection, Fraction, NonNegative, Positive
from grpod.guards.errors import GuardsError
from grpod.guards.verdict import ActionName


class _Section(ConfigSection):
    """A guard's section: it can be turned off."""

    enabled: bool = True


class WeightSyncConfig(_Section):
    """The sampler (vLLM) scores a fixed probe after every weight push; the trainer too."""

    max_nats_float32: Positive = Field(
        1e-3,
        description="largest |sampler - trainer| logprob of a probe token with a float32 "
        "trainer (measured: ~5e-7 on vLLM's CPU build), or of a sampled token where the "
        "weights are compared on the rollout (W4: healthy at most 7.0e-5, a skipped push 0.60)",
    )
    max_nats_bfloat16: Positive = Field(
        0.03,
        description="the same with a bfloat16 trunk (measured on vLLM's CPU build: clean syncs "
        "4.6e-3 to 8.2e-3, the corrupt-push drill 0.072; not measured on a GPU)",
    )
    action: ActionName = Field(
        "HALT", description="the step is never trained on at FLUSH or HALT (its compute skipped)"
    )


class AccountingConfig(_Section):
    """The zero-lr flush: never apply a step whose token accounting is corrupt."""

    mode: Literal["strict", "nonzero"] = Field(
        "strict",
        description="strict: valid == expected; nonzero: only valid > 0 (per-micro engines)",
    )
    action: ActionName = "FLUSH"


class FiniteConfig(_Section):
    """Non-finite losses, grad norms, rewards, advantages and logprobs; sentinel logprobs."""

    action: ActionName = "FLUSH"
    sentinel_logprob_max: float = Field(
        -1e3,
        description="a trainable sampler logprob at or below this is a sentinel (-9999, -1e4); "
        "a sampled token's FP32 logprob cannot go below ~-104",
    )
    weights_action: ActionName = "HALT"


class CorrelationConfig(_Section):
    """Rolling Pearson correlation of the pre-clip grad norm with 1 / valid_tokens."""

    window: int = Field(64, ge=2)
    min_steps: int = Field(16, ge=2)
    threshold: float = Field(0.8, ge=-1.0, le=1.0)
    action: ActionName = "WARN"


class ReorderConfig(_Section):
    """Run the micro with the largest chunk-0 valid count last when accounting is per-micro."""

    per_micro_accounting: bool = Field(
        False,
        description="force the reorder on (also on when the engine's fault is on or "
        "accounting.mode is nonzero)",
    )
    skip_action: ActionName = Field("FLUSH", description="the action of a skip-fast step")


# `log_metrics = ("grad_norm",)`: on the std scale, healthy W1 runs (arith, lr 1e-3, seeds 0,
# 300-638 steps) WARNed 5-17 times from step 215 on (grad norm 1.1-3.8 against a center of
# 0.26-0.34: 7-22 spreads, a group or two with reward variance); on the log scale 0 in the
# first 637 steps, then one 120x step (36.8); W4 (SmolLM2-135M, 2 x 100 steps): 0 either way.
# The loss-spike drill scales advantages by 1000 (7 log units): loss and grad norm both flag.
class SpikeConfig(_Section):
    """Rolling z-score of loss, grad norm and KL over a floored spread."""

    window: int = Field(128, ge=2)
    min_steps: int = Field(32, ge=2)
    threshold_sigma: Positive = 6.0
    spread: Literal["std", "mad"] = Field(
        "std", description="mean and std, or median and 1.4826 x MAD (robust to outliers)"
    )
    min_std: NonNegative = Field(
        1e-2,
        description="absolute floor of the spread: a move under threshold_sigma x this from a "
        "flat window is no spike",
    )
    relative_floor: NonNegative = Field(
        0.05, description="the spread is at least this fraction of |center|"
    )
    level_shift_after: int = Field(
        8, ge=1, description="after this many consecutive spikes a metric's new level is accepted"
    )
    metrics: tuple[Literal["loss", "grad_norm", "kl"], ...] = Field(
        ("loss", "grad_norm", "kl"),
        strict=False,  # TOML has no tuples
    )
    log_metrics: tuple[Literal["grad_norm"], ...] = Field(
        ("grad_norm",),
        strict=False,
        description="judged on a log scale (center: the geometric mean; spread floor: "
        "log(1 + relative_floor)): a grad norm moves by factors, and a healthy sparse-reward "
        "step reaches 12x its center; a value <= 0 is skipped",
    )
    action: ActionName = "WARN"


# `history_fraction_max` lies between W4 (healthy, 8 groups: 26 of 100 steps had every group
# alike, each after a mean of >= 0.80 over the previous 8 steps) and the equal-rewards drill
# (W1c, 16 groups, seeds 0-2: its 15 injected steps came after a mean of <= 0.54, the first
# ones after the tiny model's early steps). `tail_probability_max`: W1 healthy (16 groups)
# reached 15 of 16 alike after means of 0.64 and 0.65 (steps 358 and 372 of 2026-12-04's run;
# 50-step means 0.54-0.73, a step's fraction up to 0.94 in most of them): a chance of 0.0080
# and 0.0095 under the history's mean; the drill's 16 of 16 after <= 0.54: <= 5.2e-5.
class AdvantageConfig(_Section):
    """Signal lost: most groups alike after steps with signal, or all advantages 0 anyway."""

    zero_std_fraction_max: Fraction = 0.9
    history_steps: int = Field(8, ge=1, description="the steps whose mean fraction is compared")
    history_fraction_max: Fraction = Field(
        0.65,
        description="warn only when the previous steps' mean zero-std fraction was at most this",
    )
    tail_probability_max: Fraction = Field(
        1e-3,
        description="and only when so many groups alike is at most this likely by chance: "
        "the binomial tail over the batch's groups at the previous steps' mean",
    )
    action: ActionName = "WARN"
    all_zero_action: ActionName = Field(
        "WARN",
        description="every advantage 0 although some group's rewards varied",
    )


class SamplerMismatchConfig(_Section):
    """Sampler vs trainer logprobs: disagreement on-policy, drift (looser) when stale."""

    p99_max_nats: Positive = 1.0
    fraction_above_0_1_max: Fraction = 0.2
    drift_p99_max_nats: Positive = Field(
        4.0, description="a stale rollout (max_staleness > 0): p99 per version behind"
    )
    drift_fraction_above_0_1_max: Fraction = Field(
        0.8, description="a stale rollout: the fraction above 0.1 nats"
    )
    action: ActionName = "WARN"


class ClipConfig(_Section):
    """Clipping that suppresses real updates: small coefficient, norm far above baseline."""

    window: int = Field(32, ge=1)
    clip_coef_min: float = Field(0.2, gt=0.0, le=1.0)
    norm_ratio_max: float = Field(
        4.0,
        ge=1.0,
        description="a clipped step counts when its pre-clip grad norm exceeds this multiple "
        "of the baseline",
    )
    baseline_steps: int = Field(
        16, ge=1, description="the baseline: the median grad norm of the run's first N steps"
    )
    fraction_max: Fraction = 0.5
    action: ActionName = "WARN"


class DeadCampaignConfig(_Section):
    """A campaign that cannot learn: no reward variance, or no gradient, over many steps."""

    steps: int = Field(
        200, ge=2, description="the window: this many steps without learning signal halt"
    )
    zero_std_fraction_min: Fraction = Field(
        0.95, description="the window's mean zero-std group fraction at or above"
    )
    grad_norm_max: NonNegative = Field(
        1e-4, description="or: the window's largest pre-clip grad norm at or below"
    )
    action: ActionName = Field("HALT", description="WARN keeps a dead campaign running")


class RewardTrendConfig(_Section):
    """The reward's rolling mean falling from its best."""

    window: int = Field(100, ge=2)
    max_drop: Fraction = Field(0.25, description="fraction below the best mean")
    action: ActionName = "WARN"


class EntropyConfig(_Section):
    """The policy's mean per-token entropy collapsing."""

    window: int = Field(50, ge=1)
    floor: NonNegative = Field(0.05, description="nats: the window's mean below this warns")
    max_drop: Fraction = Field(0.9, description="fraction below the best mean")
    action: ActionName = "WARN"


# the reward_hacking guard's rules (each a finding `kind`), in the order it tests them
REWARD_HACKING_RULES = ("divergence", "length", "degeneration", "term_dominance", "kl_efficiency")


class RewardHackingConfig(_Section):
    """Reward hacking and degeneration: trend tests over a window, WARN, HALT on persistence."""

    window: int = Field(32, ge=4, description="steps each rule's trend test reads")
    min_steps: int = Field(16, ge=4, description="steps before the rules are tested")
    t_min: Positive = Field(
        4.0, description="a series rises (or falls) when its slope's t-statistic is past this"
    )
    flat_t: float = Field(
        1.0, description="a second opinion 'does not rise' when its slope's t is below this"
    )
    follow_min: NonNegative = Field(
        0.25,
        description="divergence: an audit that gained less than this fraction of the trained "
        "reward's gain (last quarter minus first) has not followed it",
    )
    min_rise: Positive = Field(
        0.1, description="the trained reward's least rise over the window (reward units)"
    )
    gap_min: NonNegative = Field(
        0.1,
        description="divergence: the trained reward's lead over the audit (last quarter) "
        "must have grown by this much and be positive",
    )
    eval_points: int = Field(
        4, ge=3, description="divergence against the eval: its last N results (eval_every apart)"
    )
    length_ratio_max: float = Field(
        2.0,
        gt=1.0,
        description="length drift: the window's last-quarter mean length over its first, or "
        "the inverse, at least this",
    )
    length_corr_min: Fraction = Field(
        0.5, description="length drift: |corr(length, reward)| at least this"
    )
    degeneration_rise_min: Positive = Field(
        0.2,
        description="degeneration: repeated 3-gram or identical-completion fraction risen by this",
    )
    fall_t: Positive = Field(
        2.0,
        description="length, degeneration, KL: the second opinion falls when its slope's t is "
        "at or below minus this",
    )
    best_drop_min: NonNegative = Field(
        0.1,
        description="length, degeneration, KL: and its last quarter is at least this below its "
        "best quarter (a converged policy at its best is not degenerating)",
    )
    term_share_max: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="one weighted term's share of the reward's rise at or above this, while "
        "another term falls",
    )
    kl_min_rise: Positive = Field(
        0.01, description="KL: its least rise over the window (nats per token)"
    )
    warn_after: int = Field(3, ge=1, description="steps in a row a rule holds before it WARNs")
    halt_after: int = Field(
        64, ge=1, description="steps in a row a rule holds before `persist_action`"
    )
    action: ActionName = Field("WARN", description="the onset")
    persist_action: ActionName = Field("HALT", description="WARN keeps a hacked campaign running")


def as_config(config: GuardsConfig | dict | None) -> GuardsConfig:
    """A GuardsConfig from itself, a dict (e.g. a TOML section) or None (the defaults); a bad
    dict is a GuardsError naming the first bad key and the reason."""
    if config is None:
        return GuardsConfig()
    if isinstance(config, GuardsConfig):
        return config
    try:
        return GuardsConfig.model_validate(config)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "guards"
        raise GuardsError(f"guards config {where}: {first['msg']}") from None


class GuardsConfig(ConfigSection):
    """Every guard's section, plus the policy's escalation and distributed settings."""

    halt_after_consecutive_flushes: int = Field(
        5, ge=0, description="this many flushed steps in a row become a HALT; 0 = never"
    )
    all_reduce: bool = Field(True, description="all-reduce (max) actions under torch.distributed")
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    accounting: AccountingConfig = AccountingConfig()
    finite: FiniteConfig = FiniteConfig()
    gradnorm_vtc_correlation: CorrelationConfig = CorrelationConfig()
    reorder: ReorderConfig = ReorderConfig()
    spike: SpikeConfig = SpikeConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    sampler_mismatch: SamplerMismatchConfig = SamplerMismatchConfig()
    clip: ClipConfig = ClipConfig()
    dead_campaign: DeadCampaignConfig = DeadCampaignConfig()
    reward_trend: RewardTrendConfig = RewardTrendConfig()
    entropy: EntropyConfig = EntropyConfig()
    reward_hacking: RewardHackingConfig = RewardHackingConfig()

    @model_validator(mode="after")
    def _check(self) -> GuardsConfig:
        for name in ("gradnorm_vtc_correlation", "spike", "reward_hacking"):
            section = getattr(self, name)
            if section.min_steps > section.window:
                raise ValueError(
                    f"{name}: min_steps {section.min_steps} exceeds window {section.window}"
                )
        return self
