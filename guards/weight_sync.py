"""`weight_sync`: the sampler does not hold the weights the trainer pushed into it.

After every push into a separate sampler (vLLM), the engine has both sides score one fixed
probe (`engine/weight_sync.py`) and the batch carries the result. Above the dtype's
threshold, or with a non-finite logprob on either side, the step's rollout came from other
weights than the policy's (a skipped or partial push, a prefix cache still holding KV blocks
of older weights): at FLUSH or HALT its compute is skipped, so nothing is trained on it. A
sampler that says it did not load some of its parameters (vLLM colocated, grpod's own
server) fails the check whatever the probe reads: one stale matrix can move the probe less
than bf16's rounding does.

On an on-policy FP32 step the weights are compared on the rollout itself (the check's
`weights = "rollout"`, engine/weight_sync.py): before the compute the guard reads the cache
half, after the forward the step's largest |sampler - trainer| logprob (the report's
`mismatch_max`) against the same limit, and the update is never applied above it.
"""

from __future__ import annotations

import math

from grpod.engine import StepReport, TransportBatch
from grpod.guards.base import Guard
from grpod.guards.verdict import Action, Finding


class WeightSyncGuard(Guard):
    """Before any compute: the batch's weight-sync check against `max_nats_<dtype>`; after
    the forward, the rollout's half of a check that has one."""

    name = "weight_sync"

    def _limit(self, dtype: str) -> float:
        if dtype == "bfloat16":
            return self.config.max_nats_bfloat16
        return self.config.max_nats_float32

    def before(self, batch: TransportBatch) -> tuple[TransportBatch | None, list[Finding]]:
        check = batch.weight_sync
        if check is None:
            return batch, []
        limit = self._limit(check.dtype)
        agrees = math.isfinite(check.max_abs_diff) and check.max_abs_diff <= limit
        if agrees and not check.unloaded:
            return batch, []
        names = ", ".join(check.unloaded[:3]) + (", ..." if len(check.unloaded) > 3 else "")
        said = (
            f"did not load {len(check.unloaded)} of its parameters ({names}; "
            if check.unloaded
            else "disagrees with the trainer ("
        )
        finding = self.finding(
            f"weight sync: the sampler {said}max |Δ| {check.max_abs_diff:.3g} nats at token "
            f"{check.position} of the probe, "
            f"{check.tokens} tokens compared, weight version {check.version}; limit {limit:g})",
            max_abs_logprob_diff=check.max_abs_diff,
            position=float(check.position),
            weight_version=float(check.version),
            cached_tokens=float(check.cached_tokens),
            threshold=limit,
            unloaded_parameters=float(len(check.unloaded)),
        )
        return (None if self.action >= Action.FLUSH else batch), [finding]

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        check = batch.weight_sync
        if check is None or not check.on_rollout:
            return []
        limit, value = self._limit(check.dtype), report.mismatch_max
        if value is not None and math.isfinite(value) and value <= limit:
            return []
        value = math.nan if value is None else value  # no token compared: never a pass
        return [
            self.finding(
                f"weight sync: the sampler's rollout disagrees with the trainer (max |Δ| "
                f"{value:.3g} nats over the step's {report.valid_tokens} tokens, weight "
                f"version {check.version}; limit {limit:g})",
                kind="rollout",
                max_abs_logprob_diff=value,
                weight_version=float(check.version),
                threshold=limit,
                tokens=float(report.valid_tokens),
            )
        ]
