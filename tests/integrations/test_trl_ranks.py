"""Two processes under `accelerate launch` (gloo, CPU): a fault on one rank flushes the step on
both, and rank 0 records both ranks' batches. A NaN advantage on rank 1 reaches rank 0 through
the gathered loss and the synced gradients; a halved num_items_in_batch on rank 1 does not:
rank 0 flushes that step only because the guards' verdict is all-reduced."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("trl")

from tests.hfdir import build_hf_dir

WORKER = Path(__file__).with_name("trl_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_both_ranks_flush_the_step_one_rank_saw_a_nan(tmp_path: Path) -> None:
    build_hf_dir(tmp_path / "model")  # once, before the ranks start
    launcher = shutil.which("accelerate", path=os.path.dirname(os.sys.executable))
    assert launcher, "accelerate's launcher is not installed beside this Python"
    # accelerate's `--cpu` with several processes goes through mpirun; `--multi_gpu` is its
    # torch.distributed launcher, and TRL's use_cpu=True makes the process group gloo on CPUs
    command = [
        launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        "--log_dir", str(tmp_path / "torchelastic"),  # torch's agent's files: not in /tmp
        str(WORKER), str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["outcomes"] for r in ranks] == [["applied", "flushed", "flushed"]] * 2

    from grpod.forensics import Store

    store = Store(tmp_path / "run", create=False)
    try:
        with store.session() as session:
            rows = [store.latest_step(session, s) for s in (1, 2)]
            verdicts = [json.loads(r.verdict_json) for r in rows]
            recorded = [[r.rank for r in store.step_ranks(session, row)] for row in rows]
    finally:
        store.close()
    assert [r.outcome for r in rows] == ["flushed", "flushed"] and recorded == [[0, 1]] * 2
    assert {f["guard"] for f in verdicts[0]["findings"]} == {"finite"}
    # rank 0's own accounting was right: it flushed for rank 1
    flushing = [f for f in verdicts[1]["findings"] if f["action"] in ("FLUSH", "HALT")]
    assert [f["guard"] for f in flushing] == ["policy"], verdicts[1]
    assert "peer rank's verdict is FLUSH" in flushing[0]["message"]
