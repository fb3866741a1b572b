"""The real pretrained model (W4: SmolLM2-135M-Instruct, FP32, `make model-smollm2`) through
the real `grpod` command, on the shipped example campaign with a tiny batch: it loads, takes
two steps with no guard finding, records them, and replays the last one bit-exactly (from
the initial checkpoint: step 0 re-applied, step 1 compared).

The model is fetched by the Makefile, never here: a missing or damaged cache fails, naming
the make target, as a missing vLLM fails the vLLM tests."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.daemon.helpers import Grpod, cli, free_port, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a 135M model on 2 cores

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "smollm2-arith"
STEPS = 2


@pytest.fixture(scope="module")
def model_dir() -> Path:
    fetch = [sys.executable, str(ROOT / "scripts" / "fetch_model.py")]
    check = subprocess.run([*fetch, "--check"], capture_output=True, text=True)
    assert check.returncode == 0, f"run `make model-smollm2` first: {check.stderr.strip()}"
    return Path(subprocess.run([*fetch, "--print-path"], capture_output=True, text=True,
                               check=True).stdout.strip())  # fmt: skip


def test_the_example_campaign_steps_records_and_replays(tmp_path: Path, model_dir: Path) -> None:
    where = tmp_path / "campaign"
    shutil.copytree(EXAMPLE, where)
    config = tomllib.loads((EXAMPLE / "grpod.toml").read_text())
    # the example's completions (24 tokens: the base model reaches an answer ~30% of the time)
    # in 4 groups: with fewer or shorter ones every group is likely to score all 0, and the
    # `advantage` guard rightly says the step has no learning signal
    config["engine"].update(  # one thread, as every test (tests/conftest.py)
        model=str(model_dir),
        prompts_per_step=4,
        group_size=4,
        micro_batch_rows=8,
        eval_every=0,
        threads=1,
    )
    config["daemon"].update(
        max_steps=STEPS, checkpoint_every=100, log_samples=0, metrics_port=free_port()
    )
    write_config(where / "grpod.toml", config)

    run = Grpod(["--config", "grpod.toml", "--run-dir", "run"], where)
    assert run.wait(timeout=1800) == 0, run.stderr[-2000:]
    steps = run.steps()
    assert [s["step"] for s in steps] == list(range(STEPS))
    for step in steps:
        assert (step["outcome"], step["verdict"]) == ("applied", "PASS"), step
        assert step["valid_tokens"] == step["expected_valid_tokens"]
        assert "findings" not in step, step["findings"]
        assert step["mismatch_p99"] < 1e-3  # the torch sampler scores what the trainer does

    replay = cli("replay", "--run-dir", "run", "--step", str(STEPS - 1), "--json",
                 cwd=where, timeout=1800)  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    result = json.loads(replay.stdout)
    assert result["reproduced"] is True, result
    assert result["recorded"] == result["replayed"]
