"""`grpod run --nproc-per-node 2` with `rollout_backend = "vllm-server"` and async steps
(`max_staleness = 1`), FSDP2 over gloo: one real vLLM server for the node, started by local
rank 0, fed by it, sampled by both ranks.

One campaign, two starts: rank 1 reaches rank 0's server and starts none; a weight-sync drill
(the push before step 1 corrupted) is caught on both ranks on its step; the server SIGKILLed
mid-run fails the same step on both ranks (one line each, one incident, the agent exits 1);
the resume re-runs that step and finishes (exit 0, the server's process group gone); every
trained batch at most one version stale on both ranks; one rank's part of an async step
replayed in one process, in an environment without vLLM.

And on policy (`max_staleness = 0`, FP32): each rank's training forward compares the pushed
weights on its own part of the rollout, and the same drill is flushed on both ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from grpod.engine.rollout.vllm_server import group_alive
from tests.daemon.helpers import cli
from tests.vllm.test_server import campaign, check_records, check_steps, replay_without_vllm

pytestmark = pytest.mark.slow

GRPOD = str(Path(sys.executable).with_name("grpod"))
DRILL = 1  # the push before this step's rollout corrupts one matrix
KILL_AFTER = 3  # the server is SIGKILLed once both ranks have logged this step
MAX_STEPS = 7
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Agent:
    """`grpod run --nproc-per-node 2 ...`: every rank's JSON log line, read as it comes
    (`on_event` runs on the reader thread); the other lines kept as text."""

    def __init__(
        self, args: list[str], cwd: Path, on_event: Callable[[dict], None] | None = None
    ) -> None:
        self.proc = subprocess.Popen(
            [GRPOD, "run", "--nproc-per-node", "2", *args],
            cwd=cwd,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.events: list[dict[str, Any]] = []
        self.text: list[str] = []
        self._on_event, self._error = on_event, None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.text.append(line)
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            self.events.append(event)
            if self._on_event is not None and self._error is None:
                try:
                    self._on_event(event)
                except BaseException as exc:  # raised again by wait()
                    self._error = exc

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self._reader.join(timeout=10)
        if self._error is not None:
            raise self._error
        return rc

    def tail(self) -> str:
        return "".join(self.text[-60:])

    def by_rank(self, name: str) -> dict[int, list[dict[str, Any]]]:
        found: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
        for event in self.events:
            if event.get("event") == name and event.get("rank") in found:
                found[event["rank"]].append(event)
        return found


@pytest.mark.timeout(2400)  # two server starts and two 2-rank jobs on a 2-core machine
@pytest.mark.usefixtures("semaphores_of_killed_servers_removed")
def test_one_server_serves_both_ranks_through_a_drill_a_killed_server_and_a_resume(
    tmp_path: Path,
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    campaign(work, DRILL)
    args = ["--config", "grpod.toml", "--run-dir", "run", "--max-steps", str(MAX_STEPS)]
    servers: list[int] = []
    logged: dict[int, set[int]] = {0: set(), 1: set()}

    def kill_the_server_once_both_ranks_passed(event: dict[str, Any]) -> None:
        if event["event"] == "rollout server" and event["started"]:
            servers.append(int(event["pid"]))
        elif event["event"] == "step":
            logged[event["rank"]].add(event["step"])
            if all(KILL_AFTER in s for s in logged.values()) and len(servers) == 1:
                os.killpg(servers[0], signal.SIGKILL)  # the server, its engine and workers
                servers.append(-1)

    first = Agent(args, work, kill_the_server_once_both_ranks_passed)
    assert first.wait(timeout=1500) == 1, first.tail()
    up = first.by_rank("rollout server")
    assert [e["started"] for e in up[0]] == [True], first.tail()
    assert [e["started"] for e in up[1]] == [False], first.tail()
    assert up[1][0]["url"] == up[0][0]["url"], up  # rank 1 samples from rank 0's server
    steps = {r: {e["step"]: e for e in events} for r, events in first.by_rank("step").items()}
    assert steps[0].keys() == steps[1].keys(), first.tail()
    failed_step = max(steps[0])
    assert failed_step > KILL_AFTER, steps[0]
    for rank in (0, 1):
        check_steps(steps[rank], failed_step, DRILL)
    # one check per push, taken by both ranks: the same numbers on each
    assert all(
        steps[0][s]["weight_sync_max_abs_logprob_diff"]
        == steps[1][s]["weight_sync_max_abs_logprob_diff"]
        for s in range(failed_step)  # the failed step's push got no check back
    )
    said = [line for line in first.text if line.startswith("grpod run:")]
    errors = [line for line in said if line.startswith(f"grpod run: error: step {failed_step}: ")]
    assert len(errors) == 2 and all("rollout server" in line for line in errors), said
    assert said[-1].startswith("grpod run: the job exits 1 (exit codes: rank 0 1, rank 1 1)"), said
    stopping = first.by_rank("stopping")
    assert [stopping[r][-1]["exit_code"] for r in (0, 1)] == [1, 1], first.tail()
    assert not group_alive(servers[0]), "the killed server's engine or workers outlived it"
    check_records(work, failed_step, DRILL)

    second = Agent(args, work)
    assert second.wait(timeout=1500) == 0, second.tail()
    started = second.by_rank("started")
    assert [started[r][-1]["next_step"] for r in (0, 1)] == [failed_step, failed_step]
    rerun = {r: {e["step"]: e for e in events} for r, events in second.by_rank("step").items()}
    for rank in (0, 1):
        mine = rerun[rank]
        assert sorted(mine) == list(range(failed_step, MAX_STEPS)), mine
        assert all(e["outcome"] == "applied" for e in mine.values()), mine
        assert all(e["weight_sync_max_abs_logprob_diff"] <= 1e-4 for e in mine.values())
        assert [mine[s]["staleness"] for s in (failed_step, failed_step + 1)] == [0, 1]
    (server,) = second.by_rank("rollout server")[0]
    assert not group_alive(int(server["pid"])), "the server's process group outlived the job"

    # an async step (sampled a version behind the policy that trained on it) with its own
    # checkpoint: `--rank R` is bit-exact only with no other step replayed before it (else
    # "within 1e-6", by design). Which steps those are depends on where the kill landed.
    async_step = next(
        s
        for s in range(failed_step + 1, MAX_STEPS)
        if (work / "run" / "checkpoints" / f"step-{s:08d}").is_dir()
    )
    assert all(rerun[r][async_step]["staleness"] == 1 for r in (0, 1)), rerun
    for rank in (0, 1):  # each rank's part alone, in one process without vLLM
        result = replay_without_vllm(work, async_step, "--rank", str(rank))
        assert result["reproduced"] is True and result["step"] == async_step, result


@pytest.mark.timeout(1200)
def test_on_policy_each_rank_checks_the_push_on_its_own_rollout(tmp_path: Path) -> None:
    """`weight_sync_on_rollout` under torchrun with the node's server: no probe forward; each
    rank's step compares the server's logprobs of its own samples with its training forward's
    (the check's value is at least the step's `mismatch_max`), so a corrupt push is caught on
    every rank (the guards' actions are all-reduced), on its step, after the forward; the steps
    around it train at FP32's rounding; each rank's part of the flushed step replays in one
    process without vLLM."""
    work = tmp_path / "work"
    work.mkdir()
    campaign(work, DRILL, max_staleness=0, checkpoint_every=1)  # every step replays bit-exact
    steps_run = 4
    args = ["--config", "grpod.toml", "--run-dir", "run", "--max-steps", str(steps_run)]
    job = Agent(args, work)
    assert job.wait(timeout=900) == 0, job.tail()
    for rank, events in job.by_rank("step").items():
        steps = {e["step"]: e for e in events}
        assert sorted(steps) == list(range(steps_run)), job.tail()
        values = {s: e["weight_sync_max_abs_logprob_diff"] for s, e in steps.items()}
        assert all(values[s] >= steps[s]["mismatch_max"] for s in steps), (rank, values)
        drill = steps.pop(DRILL)
        assert drill["outcome"] == "flushed", drill
        assert [f["guard"] for f in drill["findings"]] == ["weight_sync"], drill
        assert values[DRILL] > 1e-2, (rank, values)  # a corrupt matrix: 0.08 nats here
        assert all(e["outcome"] == "applied" for e in steps.values()), steps
        assert all(values[s] <= 1e-4 for s in steps), (rank, values)  # FP32: ~5e-7
    listed = cli("incidents", "list", "--run-dir", "run", "--json", cwd=work)
    assert listed.returncode == 0, listed.stderr
    (incident,) = json.loads(listed.stdout)
    # `rollout`: the rollout's half of the check, which the probe's route never reports
    assert (incident["step"], incident["guard"], incident["kind"]) == (
        DRILL,
        "weight_sync",
        "rollout",
    )
    for rank in (0, 1):
        result = replay_without_vllm(work, DRILL, "--rank", str(rank))
        assert result["reproduced"] is True, result
        assert (result["outcome"], result["verdict_action"]) == ("flushed", "FLUSH"), result
