"""The daemon's line about each step: the `step` log event (WARN and worse as warnings),
the async rollouts it dropped, and the progress bar on a terminal."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from grpod.daemon import logs
from grpod.daemon.progress import Progress
from grpod.engine.grpo.samples import decode_samples
from grpod.engine.verdict import Action

if TYPE_CHECKING:  # engine.step imports the Engine (torch): a type here, not an import
    from grpod.engine import Engine
    from grpod.engine.batch import TransportBatch
    from grpod.engine.grpo.step import StepResult


class StepConsole:
    """`announce(result)`: a `StepSink`'s announce hook for `grpod run`. `samples(batch)`:
    the decoded samples a step's log event carries (None: none)."""

    def __init__(
        self,
        log: Any,
        progress: Progress | None = None,
        samples: Callable[[TransportBatch], list[Any]] | None = None,
    ) -> None:
        self.log, self.progress, self.samples = log, progress, samples

    def announce(self, result: StepResult, rerun: bool = False, at: float | None = None) -> None:
        """The step's line (`at`: its time.time(), for a line sent after its step; None:
        now)."""
        for dropped in result.ahead.dropped if result.ahead is not None else ():
            self.log.warning("rollout dropped", **dataclasses.asdict(dropped))
        fields = step_fields(result)
        if self.samples is not None:
            fields["samples"] = self.samples(result.batch)
        if result.verdict.findings:
            fields["findings"] = [
                {"guard": f.guard, "action": f.action.name, "message": f.message}
                for f in result.verdict.findings
            ]
        if rerun:
            fields["rerun"] = True
        if at is not None:
            fields["ts"] = logs.iso_utc(at)
        action = result.verdict.action
        (self.log.warning if action >= Action.WARN else self.log.info)("step", **fields)
        if self.progress is not None:
            self.progress.update(result.step, result.report.reward_mean, action.name)


def step_fields(result: StepResult) -> dict[str, Any]:
    """The `step` event's fields of a step's report (without samples and findings)."""
    report = result.report
    fields: dict[str, Any] = {
        "outcome": result.outcome,
        "verdict": result.verdict.action.name,
        **report.scalars(),
        "phase_seconds": {k: round(v, 6) for k, v in result.phase_seconds.items()},
    }
    if report.kv_cache is not None:
        fields["kv_cache"] = dataclasses.asdict(report.kv_cache)
    if report.weight_version is not None:
        fields["weight_version"] = report.weight_version
    if report.weight_sync_max_abs_logprob_diff is not None:
        fields["weight_sync_max_abs_logprob_diff"] = report.weight_sync_max_abs_logprob_diff
    if report.staleness is not None:
        fields["staleness"] = report.staleness
    if report.reward_functions:
        fields["rewards"] = report.reward_functions
    return fields


def sample_decoder(
    engine: Engine, stop: Any, count: int
) -> Callable[[TransportBatch], list[Any]] | None:
    """`count` decoded samples of a step's batch for its log event (`daemon.log_samples`;
    0: None, no samples)."""
    if not count:
        return None
    return lambda batch: decode_samples(batch, engine.tokenizer, stop, count)
