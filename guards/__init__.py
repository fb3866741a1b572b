"""Health rules that intercept bad steps before their update is applied.

Guards read only `TransportBatch` and `StepReport` (engine types); `GuardPolicy` combines their
findings into one `Verdict`; `guarded_step` applies or flushes; `run_drill` injects a known
fault into the real engine and checks that it is intercepted.

Public names are imported on first use (engine/lazy.py), so a light submodule loads alone.
"""

from engine.lazy import lazy_exports

__all__ = [
    "DRILLS",
    "Action",
    "Finding",
    "GuardPolicy",
    "GuardsConfig",
    "GuardsError",
    "Verdict",
    "guarded_step",
    "run_drill",
]
__getattr__ = lazy_exports(
    __name__,
    {
        "Action": "guards.verdict",
        "DRILLS": "guards.drills",
        "Finding": "guards.verdict",
        "GuardPolicy": "guards.policy",
        "GuardsConfig": "guards.config",
        "GuardsError": "guards.errors",
        "Verdict": "guards.verdict",
        "guarded_step": "guards.policy",
        "run_drill": "guards.drills",
    },
)
