"""`reward_hacking`: the campaign's goal, watched as the numeric guards watch a step.

Every per-step number can look healthy while the policy learns to exploit its reward. Each
rule below is a trend test over the last `window` steps (guards/trend.py: a slope and its
t-statistic, never a single step), WARNs once it has held `warn_after` steps in a row and
takes `persist_action` (HALT) once it has held `halt_after`, as `dead_campaign` does:

- `divergence`: the trained reward rises (t >= t_min, by >= min_rise) while an audit reward
  (`[engine] audit_rewards`) does not (t < flat_t, or it gained less than follow_min of the
  trained reward's gain) and the trained reward's lead over it has grown by >= gap_min; or,
  over the last `eval_points` held-out evals, the eval has not risen and sits below the
  trained reward.
- `length`: the mean completion length has grown or shrunk `length_ratio_max`-fold within the
  window, in step with the reward (|corr| >= length_corr_min), while the second opinion (the
  audit rewards, else the trained reward) falls (t <= -fall_t) to best_drop_min below its
  best.
- `degeneration`: the fraction of repeated 3-grams or of identical completions in a group has
  risen by >= degeneration_rise_min (t >= t_min) while the second opinion falls from its best
  (a converging honest policy samples one answer too, and holds its reward).
- `term_dominance`: with several weighted rewards, one term explains >= term_share_max of the
  reward's rise while another term falls (t <= -t_min).
- `kl_efficiency`: KL to the reference rises (t >= t_min, by >= kl_min_rise) while the second
  opinion falls from its best: reward per unit of KL at or below zero.

Findings carry the window's curves (quarter means) and the sample of the step that shows it
best (the largest trained reward minus audit reward), which `grpod incidents show` decodes.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from grpod.guards.base import Guard, is_finite
from grpod.guards.config import REWARD_HACKING_RULES
from grpod.guards.correlation import pearson
from grpod.guards.errors import GuardsError
from grpod.guards.trend import Trend, curve_evidence, ends, trend
from grpod.guards.verdict import Action, Finding

if TYPE_CHECKING:
    from grpod.engine import StepReport, TransportBatch

RULES = REWARD_HACKING_RULES
COLUMNS = ("reward", "length", "repeated_ngram_fraction", "identical_completion_fraction", "kl")
TRAINED = "trained"  # the second opinion's name when there is no audit reward


class RewardHackingGuard(Guard):
    """Onset rules for reward hacking and degeneration (module docstring); state: the window
    of per-step records, the evals, each second opinion's best, each rule's run of steps."""

    name = "reward_hacking"

    def __init__(self, config) -> None:
        self._keep_steps((), config.window)
        self.evals: deque[tuple[int, float]] = deque(maxlen=config.eval_points)
        self.best: dict[str, float] = {}
        self.held = dict.fromkeys(RULES, 0)
        self.weights: dict[str, float] = {}
        super().__init__(config)

    def configure(self, config) -> None:
        super().configure(config)
        if self.steps.maxlen != config.window:
            self._keep_steps(self.steps, config.window)
        if self.evals.maxlen != config.eval_points:
            self.evals = deque(self.evals, maxlen=config.eval_points)

    # ----------------------------------------------------------------- inputs
    def observe_eval(self, step: int, rewards: dict[str, float]) -> None:
        """A held-out evaluation's result (engine/grpo/eval.py `EvalResult.rewards`)."""
        total = rewards.get("total", math.nan)
        if is_finite(total):
            self.evals.append((int(step), float(total)))

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        if report.skipped_compute or not is_finite(report.reward_mean):
            return []
        self._push(_record(report))
        self._memo.clear()
        if not self.weights and len(batch.function_rewards) > 1:
            self.weights = _term_weights(batch)
        if len(self.steps) < self.config.min_steps:
            return []
        findings = []
        for rule in RULES:
            found = getattr(self, f"_{rule}")()
            self.held[rule] = self.held[rule] + 1 if found else 0
            if found and self.held[rule] >= self.config.warn_after:
                message, evidence = found
                evidence.update(held_steps=float(self.held[rule]), **_example(batch, evidence))
                action = (
                    Action[self.config.persist_action]
                    if self.held[rule] >= self.config.halt_after
                    else self.action
                )
                findings.append(self.finding(message, action, rule, **evidence))
        self._update_best()
        return findings

    # ----------------------------------------------------------------- the rules
    def _divergence(self) -> tuple[str, dict[str, float]] | None:
        cfg = self.config
        trained = self._series("reward")
        rise = self._trend("reward")
        if not (rise.rising(cfg.t_min) and rise.rise >= cfg.min_rise):
            return None
        for name, values, steps in self._audits():
            audit = trend(values)
            lead = trend([trained[i] - v for i, v in zip(steps, values)])
            follows = audit.last - audit.first >= cfg.follow_min * (rise.last - rise.first)
            flat = audit.t < cfg.flat_t or not follows
            if flat and lead.last > 0 and lead.last - lead.first >= cfg.gap_min:
                return (
                    f"the trained reward rose {rise.first:.3f} -> {rise.last:.3f} over "
                    f"{rise.n} steps (t {rise.t:.1f}) while audit reward {name} did not "
                    f"({audit.first:.3f} -> {audit.last:.3f}, t {audit.t:.1f}): the policy "
                    "is paid for something the audit does not credit",
                    {
                        **curve_evidence("trained", trained, rise),
                        **curve_evidence("audit", values, audit),
                        "audit_index": float(self._audit_names().index(name)),
                    },
                )
        return self._eval_divergence(rise)

    def _eval_divergence(self, rise: Trend) -> tuple[str, dict[str, float]] | None:
        if len(self.evals) < self.config.eval_points:
            return None
        first_step = self.steps[0]["step"]
        if self.evals[0][0] < first_step:  # the evals must fall inside the trained window
            return None
        values = [v for _, v in self.evals]
        if values[-1] > values[0] or values[-1] >= rise.last:
            return None
        return (
            f"the trained reward rose {rise.first:.3f} -> {rise.last:.3f} over {rise.n} steps "
            f"(t {rise.t:.1f}) while the held-out eval did not ({values[0]:.3f} -> "
            f"{values[-1]:.3f} over steps {self.evals[0][0]}-{self.evals[-1][0]})",
            {
                **curve_evidence("trained", self._series("reward"), rise),
                **{f"eval_{k}": v for k, v in enumerate(values)},
            },
        )

    def _length(self) -> tuple[str, dict[str, float]] | None:
        cfg = self.config
        lengths = self._series("length")
        first, last = ends(lengths)  # the trend's own ends: its passes only when they moved
        if first <= 0 or last <= 0:
            return None
        ratio = last / first
        if max(ratio, 1 / ratio) < cfg.length_ratio_max:
            return None
        drift = self._trend("length")
        corr = pearson(lengths, self._series("reward")) or 0.0
        if abs(corr) < cfg.length_corr_min:
            return None
        return self._confirmed(
            f"mean completion length moved {drift.first:.1f} -> {drift.last:.1f} tokens "
            f"({ratio:.2f}x) in {drift.n} steps in step with the reward (corr {corr:.2f})",
            {
                **curve_evidence("length", lengths, drift),
                "length_ratio": ratio,
                "length_reward_corr": corr,
            },
        )

    def _degeneration(self) -> tuple[str, dict[str, float]] | None:
        cfg = self.config
        for key in ("repeated_ngram_fraction", "identical_completion_fraction"):
            values = self._series(key)
            first, last = ends(values)  # the trend's own ends: its passes only when they rose
            if last - first < cfg.degeneration_rise_min:
                continue
            rise = self._trend(key)
            if not rise.rising(cfg.t_min):
                continue
            return self._confirmed(
                f"{key.replace('_', ' ')} rose {rise.first:.3f} -> {rise.last:.3f} in {rise.n} "
                f"steps (t {rise.t:.1f})",
                curve_evidence(key, values, rise),
                "the policy repeats itself",
            )
        return None

    def _term_dominance(self) -> tuple[str, dict[str, float]] | None:
        cfg = self.config
        if len(self.weights) < 2:
            return None
        total = self._trend("reward")
        if not (total.rising(cfg.t_min) and total.rise >= cfg.min_rise):
            return None
        terms = {name: trend(self._term(name)) for name in self.weights}
        share = {name: self.weights[name] * t.rise / total.rise for name, t in terms.items()}
        top = max(share, key=share.__getitem__)
        falling = [n for n, t in terms.items() if n != top and t.t <= -cfg.t_min]
        if share[top] < cfg.term_share_max or not falling:
            return None
        return (
            f"reward term {top} explains {share[top]:.0%} of the reward's rise "
            f"({total.first:.3f} -> {total.last:.3f}) while {falling[0]} fell "
            f"({terms[falling[0]].first:.3f} -> {terms[falling[0]].last:.3f}): one term "
            "crowds out the others",
            {
                **curve_evidence("trained", self._series("reward"), total),
                **curve_evidence("falling_term", self._term(falling[0]), terms[falling[0]]),
                "top_share": share[top],
            },
        )

    def _kl_efficiency(self) -> tuple[str, dict[str, float]] | None:
        cfg = self.config
        kls = self._series("kl")
        if any(v is None for v in kls):
            return None
        drift = self._trend("kl")
        if not (drift.rising(cfg.t_min) and drift.rise >= cfg.kl_min_rise):
            return None
        opinion = self._unconfirmed()
        if opinion is None:
            return None
        name, values, gain = opinion
        return (
            f"KL to the reference rose {drift.first:.4f} -> {drift.last:.4f} nats in "
            f"{drift.n} steps (t {drift.t:.1f}) while {name} fell "
            f"({gain.first:.3f} -> {gain.last:.3f}, {gain.rise / drift.rise:.2f} per nat): "
            "drift bought no reward",
            {
                **curve_evidence("kl", kls, drift),
                **curve_evidence("opinion", values, gain),
                "gain_per_kl": gain.rise / drift.rise,
            },
        )

    # ----------------------------------------------------------------- helpers
    def _keep_steps(self, records: Iterable[dict[str, Any]], window: int) -> None:
        """The window of step records, and beside it each of `COLUMNS`' values and a count of
        the audit rewards' names, which `_push` keeps in step: a step's rules read them
        without a pass over the records."""
        records = list(records)  # may be the old window itself
        self.steps: deque[dict[str, Any]] = deque(maxlen=window)
        self._columns = {key: deque(maxlen=window) for key in COLUMNS}
        self._audited: Counter[str] = Counter()
        self._memo: dict[Any, Any] = {}  # this step's series and trends (`after` clears it)
        for record in records:
            self._push(record)

    def _push(self, record: dict[str, Any]) -> None:
        if len(self.steps) == self.steps.maxlen:
            self._audited.subtract(self.steps[0]["audits"].keys())
        self.steps.append(record)
        for key, column in self._columns.items():
            column.append(record[key])
        self._audited.update(record["audits"].keys())

    def _series(self, key: str) -> list[float]:
        """One of `COLUMNS` over the window, oldest first."""
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = list(self._columns[key])
        return found

    def _trend(self, key: str) -> Trend:
        """`trend` of `_series(key)`, computed once a step (several rules read the reward's)."""
        found = self._memo.get(("trend", key))
        if found is None:
            found = self._memo[("trend", key)] = trend(self._series(key))
        return found

    def _term(self, name: str) -> list[float]:
        return [r["terms"].get(name, 0.0) for r in self.steps]

    def _audit_names(self) -> list[str]:
        return sorted(name for name, count in self._audited.items() if count > 0)

    def _audits(self) -> list[tuple[str, list[float], list[int]]]:
        """Each audit reward's values over the window, with their positions in it (audited
        steps only); those with fewer than min_steps // audit interval values are left out."""
        if "audits" in self._memo:
            return self._memo["audits"]
        out = self._memo["audits"] = []
        for name in self._audit_names():
            pairs = [
                (i, r["audits"][name]) for i, r in enumerate(self.steps) if name in r["audits"]
            ]
            pairs = [(i, v) for i, v in pairs if math.isfinite(v)]
            if len(pairs) >= 4:
                out.append((name, [v for _, v in pairs], [i for i, _ in pairs]))
        return out

    def _opinions(self) -> list[tuple[str, list[float], Trend | None]]:
        """The second opinions (the audit rewards, else the trained reward): each one's name,
        values over the window and their trend (None under 3 values)."""
        if "opinions" not in self._memo:
            audits = [(name, values) for name, values, _ in self._audits()]
            self._memo["opinions"] = [
                (name, values, trend(values) if len(values) >= 3 else None)
                for name, values in audits
            ] or [(TRAINED, self._series("reward"), self._trend("reward"))]
        return self._memo["opinions"]

    def _confirmed(
        self, claim: str, evidence: dict[str, float], moral: str = ""
    ) -> tuple[str, dict[str, float]] | None:
        """A rule's `claim` as its finding when a second opinion fell meanwhile (the message
        says which and how, then `moral`); None when none did."""
        opinion = self._unconfirmed()
        if opinion is None:
            return None
        name, values, fell = opinion
        said = f"{claim} while {name} fell ({fell.first:.3f} -> {fell.last:.3f})"
        evidence = {**evidence, **curve_evidence("opinion", values, fell)}
        return (f"{said}: {moral}" if moral else said), evidence

    def _unconfirmed(self) -> tuple[str, list[float], Trend] | None:
        """The first second opinion (audit rewards, else the trained reward) that falls
        (t <= -fall_t) and sits below its best by best_drop_min, or None."""
        cfg = self.config
        for name, values, opinion in self._opinions():
            if opinion is None:
                continue
            best = self.best.get(name)
            fell = best is not None and best - opinion.last >= cfg.best_drop_min
            if opinion.t <= -cfg.fall_t and fell:
                return name, values, opinion
        return None

    def _update_best(self) -> None:
        for name, values, fit in self._opinions():
            last = values[-1] if fit is None else fit.last
            self.best[name] = max(self.best.get(name, -math.inf), last)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": list(self.steps),
            "evals": [list(e) for e in self.evals],
            "best": dict(self.best),
            "held": dict(self.held),
            "weights": dict(self.weights),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        try:
            self._keep_steps((dict(r) for r in state["steps"]), self.config.window)
            self.evals = deque(
                ((int(s), float(v)) for s, v in state["evals"]), maxlen=self.config.eval_points
            )
            self.best = {str(k): float(v) for k, v in state["best"].items()}
            self.held = {rule: int(state["held"].get(rule, 0)) for rule in RULES}
            self.weights = {str(k): float(v) for k, v in state["weights"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise GuardsError(f"guard {self.name}: malformed saved state ({exc!r})") from None


def _record(report: StepReport) -> dict[str, Any]:
    """What the rules read of one step (JSON-able: it is checkpointed)."""
    stats = report.completion_stats
    return {
        "step": report.step,
        "reward": float(report.reward_mean),
        "audits": {
            n: float(s["mean"]) for n, s in report.audit_rewards.items() if is_finite(s["mean"])
        },
        "terms": {
            n: float(s["mean"]) for n, s in report.reward_functions.items() if is_finite(s["mean"])
        },
        "length": float(report.completion_length_mean),
        "repeated_ngram_fraction": float(stats.get("repeated_ngram_fraction", 0.0)),
        "identical_completion_fraction": float(stats.get("identical_completion_fraction", 0.0)),
        "kl": float(report.kl) if is_finite(report.kl) else None,  # strict JSON: checkpointed
    }


def _term_weights(batch: TransportBatch) -> dict[str, float]:
    """The weights of the reward's terms, solved from the batch (rewards = terms @ weights);
    {} when the terms do not determine them (too few distinct samples)."""
    names = sorted(batch.function_rewards)
    terms = torch.tensor([batch.function_rewards[n] for n in names], dtype=torch.float64).T
    if int(torch.linalg.matrix_rank(terms)) < len(names):
        return {}
    solved = torch.linalg.lstsq(terms, batch.rewards.double().unsqueeze(1)).solution.squeeze(1)
    return {name: round(float(w), 6) for name, w in zip(names, solved)}


def _example(batch: TransportBatch, evidence: dict[str, float]) -> dict[str, float]:
    """The step's sample that shows the finding best: the largest trained reward minus audit
    reward (the finding's audit, else the first), else the largest trained reward."""
    if batch.num_samples == 0:
        return {}
    trained = batch.rewards.double()
    audits = sorted(batch.audit_rewards)
    if audits:
        name = audits[int(evidence.get("audit_index", 0)) % len(audits)]
        audit = torch.tensor(batch.audit_rewards[name], dtype=torch.float64)
        index = int(torch.argmax(torch.nan_to_num(trained - audit, nan=-math.inf)))
        return {
            "example_sample": float(index),
            "example_trained_reward": float(trained[index]),
            "example_audit_reward": float(audit[index]),
        }
    index = int(torch.argmax(torch.nan_to_num(trained, nan=-math.inf)))
    return {"example_sample": float(index), "example_trained_reward": float(trained[index])}
