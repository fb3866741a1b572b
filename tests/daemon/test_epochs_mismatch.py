"""`epochs = 2`: the sampler is compared with what the importance ratio uses (the generation's
old logprobs), on the first epoch only; a reuse step after an update is not a false alarm."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.daemon.helpers import run_to_end, write_config

pytestmark = pytest.mark.slow


def test_reuse_epochs_raise_no_sampler_mismatch(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "grpod.toml",
        {
            "engine": {
                "task": "copy",
                "prompts_per_step": 4,
                "group_size": 4,
                "seq_len": 16,
                "max_new_tokens": 2,
                "epochs": 2,
                "lr": 0.05,  # a large step: the policy moves far between the two epochs
                "threads": 1,
            },
            "daemon": {"metrics": False, "log_format": "json", "checkpoint_every": 100},
        },
    )
    run = run_to_end(["--config", str(config), "--run-dir", "run", "--max-steps", "8"], tmp_path)
    steps = run.steps()
    assert [e["step"] for e in steps] == list(range(8))
    alarms = [
        (e["step"], f["message"])
        for e in steps
        for f in e.get("findings", [])
        if f["guard"] == "sampler_mismatch"
    ]
    assert alarms == []
    first, reuse = steps[0::2], steps[1::2]
    assert all(e["mismatch_p99"] is not None and e["mismatch_p99"] < 0.01 for e in first)
    assert all(e["mismatch_p99"] is None for e in reuse)  # measured once per generation
    assert {e["outcome"] for e in steps} == {"applied"}
