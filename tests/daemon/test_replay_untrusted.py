"""`grpod replay` reads a run dir as data: the reward modules its config names are never
imported (docs/SECURITY.md). A run scored by a reward module beside its config; the module is
then replaced by one that writes a marker when imported (what a colleague with write access
to a shared directory could do); replay from another directory reproduces the step and the
marker never appears."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon.helpers import cli, free_port, tiny_config

HONEST = """
def score(prompt: str, completion: str, answer: str) -> float:
    return float(completion[:1] == answer[:1])
"""
HOSTILE = """
from pathlib import Path
Path({marker!r}).write_text("imported")

def score(prompt: str, completion: str, answer: str) -> float:
    return 0.0
"""


@pytest.mark.slow  # a daemon run
def test_replay_never_imports_the_runs_reward_modules(tmp_path: Path) -> None:
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "colleague_reward.py").write_text(HONEST)
    tiny_config(work / "grpod.toml", free_port(), {"rewards": ["colleague_reward:score"]})
    run = cli("run", "--config", "grpod.toml", "--run-dir", "run", "--max-steps", "3", cwd=work)
    assert run.returncode == 0, run.stderr
    marker = tmp_path / "marker"
    (work / "colleague_reward.py").write_text(HOSTILE.format(marker=str(marker)))
    live = subprocess.run(
        [sys.executable, "-c", "import colleague_reward"], cwd=work, capture_output=True
    )
    assert live.returncode == 0 and marker.read_text() == "imported"  # the module is live
    marker.unlink()

    replay = cli("replay", "--run-dir", str(work / "run"), "--step", "2", "--json", cwd=elsewhere)
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)["reproduced"] is True
    assert not marker.exists()
