"""`grpod drill NAME`: inject one known fault into the real engine and check the guards catch it.

The drill turns one `[engine.faults]` hook on (grpod/engine/faults.py) and decides every step
with the daemon's own `decide_step` under the default guards.

Exit 0 when every injected step was intercepted, no clean step was flagged and every flushed
step left the policy bit-identical; 1 otherwise; 2 on bad input (an unknown drill name).
"""

from __future__ import annotations

import argparse
import json

from grpod.daemon.exitcodes import EXIT_FAILURE, EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    from grpod.guards import DRILLS

    p = sub.add_parser("drill", help="run a fault drill against the guards")
    p.add_argument("name", choices=sorted(DRILLS), metavar="NAME", help=", ".join(sorted(DRILLS)))
    p.add_argument("--json", action="store_true", help="print the drill's result as JSON")
    p.add_argument("--steps", type=int, help="steps of the run (vtc-last-chunk: faulty steps)")
    p.add_argument("--clean-steps", type=int, default=50, help="vtc-last-chunk: healthy steps")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=_drill)


def _drill(args: argparse.Namespace) -> int:
    from grpod.guards import run_drill

    result = run_drill(args.name, args.steps, args.seed, clean_steps=args.clean_steps)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    elif args.name == "reward-hacking":
        from grpod.guards.hack_drill import describe

        print(describe(result))
    else:
        verdict = "ok" if result["ok"] else "FAILED"
        print(
            f"drill {result['drill']}: {verdict}: intercepted {result['intercepted']}/"
            f"{result['injected']} injected steps, {result['false_positives']} false positives "
            f"over {result['clean_steps']} clean steps, policy untouched: "
            f"{result['policy_untouched']} ({result['seconds']:.1f} s)"
        )
    return EXIT_OK if result["ok"] else EXIT_FAILURE
