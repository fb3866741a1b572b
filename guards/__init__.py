"""Health rules that intercept bad steps before their update is applied.

Guards read only `TransportBatch` and `StepReport` (engine types); `GuardPolicy` combines their
findings into one `Verdict`, as the `StepPolicy` of `grpod.engine.grpo.step.decide_step`;
`run_drill` injects a known fault into the real engine and checks that it is intercepted.

Public names are imported on first use (grpod/base/lazy.py), so a light submodule loads alone.
"""

from grpod.base.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "Action": "grpod.guards.verdict",
        "DRILLS": "grpod.guards.drills",
        "Finding": "grpod.guards.verdict",
        "GuardPolicy": "grpod.guards.policy",
        "GuardsConfig": "grpod.guards.config",
        "GuardsError": "grpod.guards.errors",
        "Verdict": "grpod.guards.verdict",
        "run_drill": "grpod.guards.drills",
    },
)
