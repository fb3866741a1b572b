"""A recorder that writes large batches until it is killed (run by test_crash.py)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from grpod.forensics import FlightRecorder, ForensicsConfig
from tests.forensics.test_store import decided, tiny_batch, tiny_report


def main(run_dir: str, run_id: str) -> None:
    torch.set_num_threads(1)
    shape = (8, 32, 512)  # ~1 MiB per token tensor: writes take a while
    base = tiny_batch(0)
    big = replace(
        base,
        input_ids=torch.randint(0, 15, shape),
        position_ids=torch.arange(512).expand(shape).clone(),
        loss_mask=torch.rand(shape) > 0.5,
        advantages=torch.randn(shape),
        sampler_logprobs=-torch.rand(shape),
        sample_ids=torch.zeros(shape, dtype=torch.int32),
        group_ids=torch.zeros(shape, dtype=torch.int32),
    )
    recorder = FlightRecorder(Path(run_dir), ForensicsConfig(queue_size=2))
    recorder.start_run(run_id, {"engine": {}}, {}, "cpu")
    step = 0
    while True:
        batch = replace(big, step=step, input_ids=big.input_ids.roll(step, -1))
        verdict = {"action": "WARN" if step % 3 == 0 else "PASS", "findings": []}
        recorder.record(decided(batch, tiny_report(step), verdict, "applied"))
        print(step, recorder.recorded_total, flush=True)
        step += 1


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
