"""Health rules that intercept bad steps before their update is applied.

Guards read only `TransportBatch` and `StepReport` (engine types); `GuardPolicy` combines their
findings into one `Verdict`; `guarded_step` applies or flushes; `run_drill` injects a known
fault into the real engine and checks that it is intercepted.
"""

from guards.config import GuardsConfig
from guards.drills import DRILLS, run_drill
from guards.errors import GuardsError
from guards.policy import GuardPolicy, guarded_step
from guards.verdict import Action, Finding, Verdict

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
