"""One rank of a guarded TRL run under `accelerate launch` (tests/integrations/test_trl_ranks.py):
rank 1 alone gets a NaN advantage at step 1 and a halved num_items_in_batch at step 2;
every rank writes its outcomes to rank-R.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script by accelerate launch
    sys.path.insert(0, str(ROOT))

from transformers import TrainerCallback  # noqa: E402

from tests.integrations.trlrun import Faults, build_trainer  # noqa: E402


def main(root: Path) -> None:
    trainer = build_trainer(root, max_steps=3, faults=Faults({1}, set(), {2}, rank=1))
    outcomes: list[str] = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            outcomes.append(str(trainer.grpod_last.outcome))

    trainer.add_callback(Watch())
    trainer.train()
    rank = trainer.accelerator.process_index
    (root / f"rank-{rank}.json").write_text(json.dumps({"outcomes": outcomes}))
    # no rank tears gloo down while its peer still uses it, and no interpreter finalization:
    # gloo's threads can abort it ("terminate called without an active exception", SIGABRT),
    # as grpod's own ranks do (daemon/distributed.py: leave)
    trainer.accelerator.wait_for_everyone()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
