"""`grpod run` with `rollout_backend = "vllm-server"` and async steps (`max_staleness = 1`): a
real vLLM OpenAI server process that grpod starts (its malloc set to keep what pushes free),
feeds weights in place through shared memory and stops, sampling each next step while the
trainer trains. One campaign, two starts: a weight-sync drill caught on its step, then the
server SIGKILLed (one line, an incident, exit 1, nothing half-written, no orphan); a resume
that re-runs the failed step and stops on SIGTERM (the server's process group gone after the
daemon exits); every trained batch at most one version stale; `grpod replay` of an async
server-sampled step in an environment without vLLM. (The on-policy server path shares every
request and push; its failure cases run against a stand-in server in tests/engine.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from grpod.engine.rollout.vllm_server import group_alive
from tests.daemon.helpers import SERVER_ENGINE, Grpod, cli, write_config

MAIN_GRPOD = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "grpod"
DRILL = 2  # the push before this step's rollout corrupts one matrix
MAX_STEPS = 12


def campaign(
    work: Path, drill: int = DRILL, max_staleness: int = 1, checkpoint_every: int = 2
) -> None:
    """The campaign's config: the push before step `drill` corrupted."""
    write_config(
        work / "grpod.toml",
        {
            "engine": {
                **SERVER_ENGINE,
                "max_new_tokens": 4,
                "weight_sync_probe_tokens": 128,
                "max_staleness": max_staleness,
                "faults": {"weight_sync_corrupt_steps": [drill]},
            },
            "daemon": {
                "metrics": False,
                "log_format": "json",
                "progress": "off",
                "checkpoint_every": checkpoint_every,
            },
            "forensics": {"episode_gap_steps": 0},
            "guards.weight_sync": {"action": "FLUSH"},  # go on after the drill
        },
    )


def check_steps(steps: dict[int, dict[str, Any]], failed_step: int, drill: int = DRILL) -> None:
    """A rank's step events up to the killed server's step: the drill's step skipped by the
    weight-sync check, the failed step by the rollout guard, every other one trained after a
    clean sync and at most a version stale; steps 0 and 1 both sampled at version 0."""
    at_drill = steps[drill]
    assert at_drill["outcome"] == "skipped", at_drill
    assert [f["guard"] for f in at_drill["findings"]] == ["weight_sync"], at_drill
    assert not float(at_drill["weight_sync_max_abs_logprob_diff"]) <= 1e-3, at_drill
    assert steps[failed_step]["outcome"] == "skipped", steps[failed_step]
    assert [f["guard"] for f in steps[failed_step]["findings"]] == ["rollout"]
    trained = [s for s, e in steps.items() if e["outcome"] == "applied"]
    assert trained == [s for s in range(failed_step) if s != drill], steps
    assert all(steps[s]["weight_sync_max_abs_logprob_diff"] <= 1e-4 for s in trained)
    assert all(steps[s]["staleness"] <= 1 for s in trained), steps
    assert [steps[s]["staleness"] for s in (0, 1)] == [0, 1]


def check_records(work: Path, failed_step: int, drill: int = DRILL) -> None:
    """The campaign's store: an incident for the drill's step and one for the failed step
    (the killed server's), and nothing half-written."""
    listed = cli("incidents", "list", "--run-dir", "run", "--json", cwd=work)
    assert listed.returncode == 0, listed.stderr
    incidents = {i["guard"]: i for i in json.loads(listed.stdout)}
    assert incidents["rollout"]["step"] == failed_step, incidents
    assert incidents["weight_sync"]["step"] == drill, incidents
    checked = cli("fsck", "--run-dir", "run", cwd=work)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def replay_without_vllm(work: Path, step: int, *args: str) -> dict[str, Any]:
    """The result of `grpod replay` of `step` (`args`: more options) by the main environment,
    which has no vLLM: a server-sampled step replays from its batch alone."""
    assert MAIN_GRPOD.is_file(), "make test-vllm builds .venv first"
    replay = ["replay", "--run-dir", "run", "--step", str(step), *args, "--json"]
    done = subprocess.run(
        [str(MAIN_GRPOD), *replay], cwd=work, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def process_environ(pid: int) -> dict[str, str]:
    """The environment process `pid` started with (/proc: the same user's process)."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().partition("=")[::2] for e in entries if b"=" in e)


def server_pid(run: Grpod) -> int:
    event = run.event("rollout server")
    assert event["started"] is True and event["url"].startswith("unix:/"), event
    return int(event["pid"])


@pytest.mark.timeout(1800)  # two server starts: ~1 min each on an idle 2-core machine
@pytest.mark.usefixtures("semaphores_of_killed_servers_removed")
def test_a_server_campaign_survives_a_killed_server_sigterm_and_replays(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    campaign(work)
    args = ["--config", "grpod.toml", "--run-dir", "run", "--max-steps", str(MAX_STEPS)]
    killed: list[int] = []
    environ: dict[str, str] = {}

    def kill_the_server_after_the_drill(event: dict[str, Any]) -> None:
        if event["event"] == "rollout server":
            killed.append(int(event["pid"]))
            environ.update(process_environ(killed[0]))
        elif event["event"] == "step" and event["step"] == DRILL + 1:
            os.killpg(killed[0], signal.SIGKILL)  # the server, its engine and its workers

    # a one-page log pipe: the daemon is never more than a page of log past the kill
    first = Grpod(args, work, on_event=kill_the_server_after_the_drill, pipe_bytes=4096)
    assert first.wait(timeout=1200) == 1, first.stderr[-3000:]
    steps = {e["step"]: e for e in first.steps()}
    assert steps[0]["weight_sync_max_abs_logprob_diff"] <= 1e-4, steps[0]
    failed_step = max(steps)
    assert failed_step > DRILL + 1, steps
    check_steps(steps, failed_step)
    # a CPU server's malloc keeps what each push's reload frees (vllm_server_cpu_malloc)
    assert environ["MALLOC_MMAP_MAX_"] == "0", sorted(environ)
    assert int(environ["MALLOC_TRIM_THRESHOLD_"]) >= 1 << 30
    lines = [line for line in first.stderr.splitlines() if line.startswith("grpod run:")]
    assert len(lines) == 1 and f"step {failed_step}: rollout server unix:/" in lines[0]
    assert "(the server exited with status -9" in lines[0], lines
    assert first.event("stopping")["exit_code"] == 1
    assert not group_alive(killed[0]), "the killed server's engine or workers outlived it"
    check_records(work, failed_step)

    def stop_after_the_rerun(event: dict[str, Any]) -> None:
        if event["event"] == "step" and event["step"] == failed_step + 1:
            second.signal(signal.SIGTERM)

    second = Grpod(args, work, on_event=stop_after_the_rerun, pipe_bytes=4096)
    assert second.wait(timeout=1200) == 0, second.stderr[-3000:]
    assert second.event("started")["next_step"] == failed_step  # the failed step runs again
    assert "stopped by SIGTERM" in second.event("stopping")["reason"]
    rerun = {e["step"]: e for e in second.steps()}
    assert rerun[failed_step]["outcome"] == "applied", rerun
    assert all(e["weight_sync_max_abs_logprob_diff"] <= 1e-4 for e in rerun.values()), rerun
    # the resumed window samples from the checkpoint's weights: the rerun is fresh, the next
    # step was sampled while the rerun trained, one version behind
    assert [rerun[s]["staleness"] for s in (failed_step, failed_step + 1)] == [0, 1], rerun
    assert not group_alive(server_pid(second)), "the server's process group outlived the daemon"

    async_step = failed_step + 1  # sampled a version behind the policy that trained on it
    result = replay_without_vllm(work, async_step)
    assert result["reproduced"] is True and result["step"] == async_step, result
