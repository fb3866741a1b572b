"""Records acknowledged, incident and held steps, then waits to be killed (test_group_commit)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from grpod.forensics import FlightRecorder, ForensicsConfig
from tests.forensics.test_store import PASS, WARN, decided, tiny_batch, tiny_report


def main(run_dir: str, inline_bytes: str) -> None:
    config = ForensicsConfig(
        commit_every_steps=8, commit_interval_seconds=3600, inline_blob_bytes=int(inline_bytes)
    )
    recorder = FlightRecorder(Path(run_dir), config)
    recorder.start_run("r", {"engine": {}}, {}, "cpu")
    for step in range(5):
        recorder.record(decided(tiny_batch(step), tiny_report(step), PASS, "applied"))
    recorder.drain()  # steps 0-4 acknowledged
    for step, verdict in ((5, PASS), (6, PASS), (7, WARN)):  # the incident commits 5-7
        recorder.record(decided(tiny_batch(step), tiny_report(step), verdict, "applied"))
    for step in (8, 9):  # held, not acknowledged
        recorder.record(decided(tiny_batch(step), tiny_report(step), PASS, "applied"))
    while recorder.recorded_total < 8 or recorder.uncommitted_steps < 2:
        time.sleep(0.001)
    print(recorder.recorded_total, recorder.uncommitted_steps, flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
