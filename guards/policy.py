"""`GuardPolicy` combines the guards' findings into one verdict: the `StepPolicy` under which
`grpod.engine.grpo.step.decide_step` decides a step's update.

Order is fixed: weight_sync and reorder (before), accounting, finite,
gradnorm_vtc_correlation, spike, advantage, sampler_mismatch, clip, dead_campaign,
reward_trend, entropy, reward_hacking. Under
torch.distributed every decision (skip, action, the weights check) is all-reduced with max,
so all ranks apply, flush or skip the same step.
"""

from __future__ import annotations

from typing import Any

import torch

from grpod.base import collectives
from grpod.base.collectives import local
from grpod.engine import StepReport, TransportBatch
from grpod.engine.model.flat import storage_cover
from grpod.guards.accounting import AccountingGuard
from grpod.guards.advantage import AdvantageGuard
from grpod.guards.base import Guard
from grpod.guards.campaign import DeadCampaignGuard, RewardTrendGuard
from grpod.guards.clip import ClipGuard
from grpod.guards.config import GuardsConfig, as_config
from grpod.guards.correlation import GradNormVTCCorrelationGuard
from grpod.guards.entropy import EntropyGuard
from grpod.guards.errors import GuardsError
from grpod.guards.finite import FiniteGuard
from grpod.guards.mismatch import SamplerMismatchGuard
from grpod.guards.reorder import ReorderGuard
from grpod.guards.reward_hacking import RewardHackingGuard
from grpod.guards.spike import SpikeGuard
from grpod.guards.verdict import Action, Finding, Verdict
from grpod.guards.weight_sync import WeightSyncGuard

GUARD_CLASSES: tuple[type[Guard], ...] = (
    WeightSyncGuard,
    ReorderGuard,
    AccountingGuard,
    FiniteGuard,
    GradNormVTCCorrelationGuard,
    SpikeGuard,
    AdvantageGuard,
    SamplerMismatchGuard,
    ClipGuard,
    DeadCampaignGuard,
    RewardTrendGuard,
    EntropyGuard,
    RewardHackingGuard,
)
STATE_FORMAT = "grpod.guards_state/1"


class GuardPolicy:
    """The enabled guards in a fixed order, their combined verdict, and escalation."""

    def __init__(self, config: GuardsConfig | dict | None = None) -> None:
        self.config = as_config(config)
        self.guards: dict[str, Guard] = {
            cls.name: cls(getattr(self.config, cls.name)) for cls in GUARD_CLASSES
        }
        # the guards that have a before-hook (most have only `after`): a step calls no empty
        # hook, right after the rollout when every call runs on cold caches
        self._before = [g for g in self.guards.values() if type(g).before is not Guard.before]
        self.consecutive_flushes = 0
        self._model: Any = None  # the model whose parameter list `_weights` holds
        self._weights: list[torch.Tensor] = []
        self._cover: torch.Tensor | None = None  # one tensor over `_weights`' shared storage

    # ----------------------------------------------------------------- the hooks
    def before(
        self, batch: TransportBatch, *, per_micro_accounting: bool = False
    ) -> tuple[TransportBatch, list[Finding], bool]:
        """Run the before-hooks: `(batch to run, findings, skip the compute?)`.

        `per_micro_accounting`: the engine's counter is per-micro (`Engine.per_micro_accounting`);
        the reorder guard runs only then, or when configured so, or in accounting mode `nonzero`.
        """
        reorder = (
            per_micro_accounting
            or self.config.reorder.per_micro_accounting
            or (self.config.accounting.enabled and self.config.accounting.mode == "nonzero")
        )
        findings: list[Finding] = []
        skip = False
        for guard in self._before:
            if not guard.enabled:
                continue
            if guard.name == "reorder" and not reorder:
                continue  # a step-accumulated counter reads the step total in any micro order
            out, found = guard.before(batch)
            findings += found
            if out is None:
                skip = True
                break
            batch = out
        if self._all_reduce() and collectives.all_reduce_max(int(skip)) and not skip:
            skip = True
            findings.append(
                Finding("policy", Action.FLUSH, "a peer rank skips this step's compute", {})
            )
        return batch, findings, skip

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        """Run the after-hooks of the enabled guards on the batch as run and its report."""
        findings: list[Finding] = []
        for guard in self._enabled():
            findings += guard.after(batch, report)
        return findings

    def observe_eval(self, step: int, rewards: dict[str, float]) -> None:
        """A held-out evaluation's rewards (engine/grpo/eval.py), for `reward_hacking`'s rule."""
        self.guards["reward_hacking"].observe_eval(step, rewards)  # type: ignore[attr-defined]

    def decide(self, findings: list[Finding]) -> Verdict:
        """One verdict: the highest action, all-reduced over ranks, escalated after
        `halt_after_consecutive_flushes` flushed steps in a row."""
        findings = list(findings)
        action = Verdict.of(findings).action
        if self._all_reduce():
            reduced = Action(collectives.all_reduce_max(int(action)))
            if reduced > action:
                findings.append(
                    Finding(
                        "policy",
                        reduced,
                        f"a peer rank's verdict is {reduced.name}",
                        {"local_action": float(action), "rank": float(collectives.rank())},
                    )
                )
                action = reduced
        if action >= Action.FLUSH:
            self.consecutive_flushes += 1
            limit = self.config.halt_after_consecutive_flushes
            if limit and self.consecutive_flushes >= limit and action < Action.HALT:
                findings.append(
                    Finding(
                        "policy",
                        Action.HALT,
                        f"{self.consecutive_flushes} consecutive flushed steps (limit {limit})",
                        {"consecutive_flushes": float(self.consecutive_flushes)},
                    )
                )
        else:
            self.consecutive_flushes = 0
        return Verdict.of(findings)  # built once, from every finding

    def check_weights(
        self, weights: list[torch.Tensor], cover: torch.Tensor | None = None
    ) -> list[Finding]:
        """After an apply: the finite guard's weights check, all-reduced over ranks. `cover`:
        one tensor over the storage that holds all of `weights` (`weights_cover`)."""
        finite = self.guards["finite"]
        found = finite.check_weights(weights, cover) if finite.enabled else []  # type: ignore[attr-defined]
        local = max((f.action for f in found), default=Action.PASS)
        if self._all_reduce():
            reduced = Action(collectives.all_reduce_max(int(local)))
            if reduced > local:
                found.append(
                    Finding("policy", reduced, f"a peer rank's weights check is {reduced.name}", {})
                )
        return found

    def after_apply(self, model: torch.nn.Module) -> list[Finding]:
        """After an apply: `check_weights` over `model`'s parameters."""
        return self.check_weights(self.weights_of(model), self.weights_cover)

    def weights_of(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """`model`'s parameters, listed once per model (not walked again every step), and
        walked again when they moved out of the storage they shared (`.to()`, a reassigned
        `.data`): `weights_cover` is then never stale."""
        if model is not self._model or self._cover_moved():
            # a sharded model's DTensors: this rank's shards (each rank checks its own)
            self._model, self._weights = model, [local(p) for p in model.parameters()]
            self._cover = storage_cover(self._weights)
        return self._weights

    @property
    def weights_cover(self) -> torch.Tensor | None:
        """After `weights_of`: one 1-D tensor over the storage all of the model's parameters
        live in (the engine's `flatten_parameters`), or None when they do not share one."""
        return self._cover

    def _cover_moved(self) -> bool:
        if self._cover is None:
            return False
        ptr = self._cover.untyped_storage().data_ptr()
        return any(
            w.untyped_storage().data_ptr() != ptr for w in (self._weights[0], self._weights[-1])
        )

    # ----------------------------------------------------------------- state
    @property
    def gradnorm_vtc_correlation(self) -> float | None:
        """The rolling correlation of grad norm and expected/valid tokens (None until min_steps,
        or while the counter equals the loss mask)."""
        return self.guards["gradnorm_vtc_correlation"].value  # type: ignore[attr-defined]

    @property
    def skip_fast_total(self) -> int:
        return self.guards["reorder"].skip_fast_total  # type: ignore[attr-defined]

    def reload(self, config: GuardsConfig | dict) -> None:
        """SIGHUP: new thresholds and switches; every guard keeps its history."""
        self.config = as_config(config)
        for name, guard in self.guards.items():
            guard.configure(getattr(self.config, name))

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state (windows, counters) to save with a checkpoint."""
        return {
            "format": STATE_FORMAT,
            "consecutive_flushes": self.consecutive_flushes,
            "guards": {name: guard.state_dict() for name, guard in self.guards.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`; a malformed state is a GuardsError naming what is wrong."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise GuardsError(f"guards state: format is {found!r}, not {STATE_FORMAT}")
        saved = state.get("guards", {})
        if not isinstance(saved, dict):
            raise GuardsError("guards state: 'guards' is not a mapping")
        unknown = set(saved) - set(self.guards)
        if unknown:
            raise GuardsError(f"guards state: unknown guards {sorted(unknown)}")
        try:
            self.consecutive_flushes = int(state.get("consecutive_flushes", 0))
        except (TypeError, ValueError):
            raise GuardsError("guards state: consecutive_flushes is not an integer") from None
        for name, guard in self.guards.items():
            guard.load_state_dict(saved.get(name, {}))

    def _enabled(self) -> list[Guard]:
        return [g for g in self.guards.values() if g.enabled]

    def _all_reduce(self) -> bool:
        return self.config.all_reduce and collectives.initialized()
