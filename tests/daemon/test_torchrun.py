"""`grpod run --nproc-per-node 2` (grpod's agent over torch's elastic launcher) and `grpod
replay` under a real `torchrun --nproc-per-node 2` (gloo, CPU).

One campaign: start, SIGTERM to the agent mid-run (every rank finishes the step, checkpoints
collectively with DCP and exits 0; the agent exits 0, having told systemd READY once every rank
was up, WATCHDOG and STOPPING), resume from that checkpoint on the same world size, then replay
the last step under torchrun (global loss, valid tokens and grad norm bit-exact) and one rank's
part alone in one process (its local valid tokens and loss); last, one job loses a worker to
SIGKILL (the agent tears it down and exits 1), and one process (world size 1) resumes the last
complete 2-rank checkpoint resharded, past a half-written one. Then a short `parallel = "ddp"`
LoRA campaign a guard HALTs (exit 3; one rank, then the whole step replayed in one process),
two "nodes" on loopback (`--nnodes 2`, one rank each, one run dir), a node's rollout server
that dies while starting (every rank's one line, exit 1, nothing created), a
LoRA campaign under `fsdp2` stopped, resumed, replayed and exported, and a job a rank refuses
before its first step (exit 2, one line per rank, nothing created).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpod.engine import Engine, EngineConfig
from tests.daemon.helpers import (
    GRPOD,
    TINY_ENGINE,
    W2_ENGINE,
    NotifySocket,
    free_port,
    http_get,
    parse_metrics,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ENGINE = W2_ENGINE  # W2 (long prompts, 256-token rows in 4 sequence chunks), one row per micro
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
# the agent waits for its ranks' graceful stop however long it takes: a failure bound here
GRACE_SECONDS = 180


def torchrun(*args: str, logs: Path) -> list[str]:
    """A plain torchrun of `grpod args`; `logs`: its agent's directory (else one in /tmp)."""
    return [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--log-dir", str(logs), GRPOD, *args]


def launcher(*args: str) -> list[str]:
    """`grpod run` under grpod's own agent, 2 ranks."""
    return [GRPOD, "run", "--nproc-per-node", "2", *args]


def replay_result(command: list[str], timeout: float = 120) -> dict:
    """The result of a `grpod replay ... --json` (alone, or under torchrun) that succeeded."""
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def events(text: str, name: str) -> dict[int, dict]:
    """The last log event `name` of each rank."""
    found = {}
    for line in text.splitlines():
        if line.startswith("{") and f'"event": "{name}"' in line:
            event = json.loads(line)
            found[event["rank"]] = event
    return found


def _json_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("{")]


@contextlib.contextmanager
def _agent(args: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """An agent (stdout and stderr) logging to `log`; killed if the test leaves it running."""
    with open(log, "w") as out:
        agent = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield agent
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()


def _wait(agent: subprocess.Popen, done: Callable[[], bool], what: str) -> None:
    """Until `done` holds while the job runs (150 s: a failure bound; polled at 5 Hz)."""
    wait_until(done, what, lambda: agent.poll() is None, timeout=150, every=0.2)


def _status_step(run_dir: Path) -> int:
    """The last step the run's status file names (-1: none yet)."""
    status = run_dir / "status.json"
    try:
        return json.loads(status.read_text()).get("step") or -1
    except (OSError, ValueError):
        return -1


def _max_recorded(run_dir: Path) -> int:
    """The highest step the store has committed (-1: none); WAL: safe while a run writes."""
    with sqlite3.connect(run_dir / "grpod.sqlite") as db:
        (step,) = db.execute("SELECT max(step) FROM steps").fetchone()
    return -1 if step is None else step


def test_sigterm_to_the_agent_checkpoints_every_rank_then_resume_and_replay(tmp_path) -> None:
    port = free_port()
    config = write_config(
        tmp_path / "grpod.toml",
        {"engine": ENGINE, "daemon": {"metrics_port": port, "checkpoint_every": 100}},
    )
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    args = launcher("--config", str(config), "--run-dir", str(run_dir), "--max-steps", "0")
    notify = NotifySocket(tmp_path / "notify.sock")
    with _agent(args, log, {**ENV, "NOTIFY_SOCKET": str(notify.path)}) as agent:
        _wait(agent, lambda: _status_step(run_dir) >= 1, "step 1 in status.json")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=GRACE_SECONDS + 60) == 0, log.read_text()[-3000:]
    notify.close()
    text = log.read_text()
    assert "Traceback" not in text
    # the agent's own messages only (a rank's would carry GRPOD_RANK): READY once both ranks
    # were up, then the watchdog while they stepped, STOPPING on the signal
    assert notify.fields("GRPOD_RANK") == [] and notify.fields("READY") == ["1"]
    kinds = [m.split("=", 1)[0] for m in notify.messages]
    assert "WATCHDOG" in kinds[kinds.index("READY") :] and "STOPPING" in kinds
    (ready,) = [m for m in notify.messages if m.startswith("READY=1")]
    assert ready.startswith("READY=1\nSTATUS=2 ranks up; ready"), ready
    stopped = events(text, "stopped")
    assert set(stopped) == {0, 1}, text[-3000:]
    assert {e["exit_code"] for e in stopped.values()} == {0}
    assert {e["reason"] for e in stopped.values()} == {"stopped by SIGTERM"}
    stop_step = stopped[0]["next_step"]
    assert stopped[1]["next_step"] == stop_step >= 2
    checkpoint = run_dir / "checkpoints" / f"step-{stop_step:08d}"
    assert (checkpoint / "state.json").is_file() and (checkpoint / ".metadata").is_file()
    assert {p.name for p in checkpoint.glob("rank-*")} == {"rank-0", "rank-1"}
    assert all((checkpoint / f"rank-{r}" / "state.json").is_file() for r in (0, 1))
    assert not list((run_dir / "checkpoints").glob(".*tmp*"))

    # resumed without a step limit: scraped while both ranks run, then stopped by SIGTERM
    # (a rank that has finished is no longer up; a scrape after the last step races that)
    log = tmp_path / "resumed.log"
    scraped: dict[str, float] = {}

    def scrape_of_a_resumed_step() -> bool:
        nonlocal scraped
        try:  # one endpoint, on local rank 0, with both ranks' series
            scraped = parse_metrics(http_get(f"http://127.0.0.1:{port}/metrics", 2)[1])
        except OSError:
            return False
        step = scraped.get("grpod_step", -1)  # rank 0 publishes it after every rank's series
        ranks = [scraped.get(f'grpod_rank_step{{rank="{r}"}}') for r in (0, 1)]
        return step >= stop_step and ranks == [step, step]

    args = launcher("--run-dir", str(run_dir), "--max-steps", "0")
    with _agent(args, log, ENV) as agent:
        _wait(agent, scrape_of_a_resumed_step, "a scrape of a resumed step")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=GRACE_SECONDS + 60) == 0
    text = log.read_text()
    stopped = events(text, "stopped")
    assert [stopped.get(r, {}).get("exit_code") for r in (0, 1)] == [0, 0], text[-3000:]
    last = stopped[0]["next_step"] - 1
    assert stopped[1]["next_step"] == last + 1 and last >= scraped["grpod_step"]
    started = events(text, "started")
    assert [started[r]["resumed_from"] for r in (0, 1)] == [stop_step, stop_step]
    # every rank's multiprocess files, of this start's processes only (emptied at start)
    files = list((run_dir / "prometheus" / "node-0").glob("*.db"))
    assert {int(f.stem.rsplit("_", 1)[1]) for f in files} == {started[r]["pid"] for r in (0, 1)}
    assert [scraped[f'grpod_rank_up{{rank="{r}"}}'] for r in (0, 1)] == [1, 1]

    with sqlite3.connect(run_dir / "grpod.sqlite") as db:
        rows = db.execute("SELECT step, report_json FROM steps ORDER BY step, id").fetchall()
        ranks = db.execute(
            "SELECT step, rank, valid_tokens FROM step_ranks ORDER BY step, rank"
        ).fetchall()
    assert [s for s, _ in rows] == list(range(last + 1))  # every step recorded once, by rank 0
    assert [(s, r) for s, r, _ in ranks] == [(s, r) for s in range(last + 1) for r in (0, 1)]
    by_step = {s: [v for t, _, v in ranks if t == s] for s in range(last + 1)}
    assert all(
        by_step[s] == [r["valid_tokens"] for r in json.loads(t)["rank_reports"]] for s, t in rows
    )
    for _, text_report in rows:
        report = json.loads(text_report)
        assert [r["rank"] for r in report["rank_reports"]] == [0, 1]
        assert report["global_valid_tokens"] == sum(report["rank_expected_valid_tokens"])
        assert report["global_valid_tokens"] == sum(
            r["valid_tokens"] for r in report["rank_reports"]
        )

    replay = torchrun(
        "replay", "--run-dir", str(run_dir), "--step", str(last), "--json", logs=tmp_path / "tr"
    )
    result = replay_result(replay, timeout=180)
    rank_valid = [scraped[f'grpod_rank_valid_tokens{{rank="{r}"}}'] for r in (0, 1)]
    scraped_report = json.loads(rows[int(scraped["grpod_step"])][1])  # rows: one per step
    assert rank_valid == [r["valid_tokens"] for r in scraped_report["rank_reports"]]
    assert scraped["grpod_global_valid_tokens"] == sum(rank_valid)
    assert scraped['grpod_rank_phase_duration_seconds{phase="grad",rank="1"}'] > 0

    assert result["reproduced"] is True, result
    assert result["recorded"] == result["replayed"]
    assert result["recorded"]["valid_tokens"] == json.loads(rows[-1][1])["global_valid_tokens"]

    alone = subprocess.run(
        [GRPOD, "replay", "--run-dir", str(run_dir), "--step", str(last), "--rank", "1", "--json"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(alone.stdout.strip().splitlines()[-1])
    # past steps run in one process: bit-exact on this CPU, else within the stated tolerance
    assert result["reproduced"] is True or result["reproduced"].startswith("within 1e-6"), result
    rank_1 = json.loads(rows[-1][1])["rank_reports"][1]
    assert result["replayed"] == {
        "valid_tokens": rank_1["valid_tokens"],
        "local_loss": rank_1["local_loss"],
    }

    # SIGKILL of one worker: the agent tears the job down (no checkpoint after step last + 1:
    # none is due, however long the job runs before the kill)
    log = tmp_path / "killed.log"
    never = write_config(
        tmp_path / "killed.toml",
        {"engine": ENGINE, "daemon": {"metrics_port": port, "checkpoint_every": 1 << 30}},
    )
    args = launcher("--config", str(never), "--run-dir", str(run_dir), "--max-steps", "0")

    def both_ranks_past_last() -> bool:  # step last + 2 committed: the resume below re-runs it
        return len(events(log.read_text(), "started")) == 2 and _max_recorded(run_dir) >= last + 2

    with _agent(args, log, ENV) as agent:
        _wait(agent, both_ranks_past_last, "both ranks and step last + 2")
        os.kill(events(log.read_text(), "started")[1]["pid"], signal.SIGKILL)
        assert agent.wait(timeout=90) == 1  # a crashed rank: systemd restarts the job
    killed = [json.loads(line) for line in _json_lines(log)]
    assert not [e for e in killed if e["event"] == "checkpoint"]  # no checkpoint after a failure
    # rank 0 sees its peer gone at the next collective: exit 1 (systemd restarts), if it had time
    assert {e["exit_code"] for e in killed if e["event"] == "stopped"} <= {1}

    # a world size of 1 resumes the last complete 2-rank DCP checkpoint (resharded: model,
    # optimizer), past a half-written checkpoint directory a killed job leaves (never chosen)
    final = run_dir / "checkpoints" / f"step-{last + 1:08d}"
    assert (final / ".metadata").is_file()
    half = run_dir / "checkpoints" / f".step-{last + 5:08d}.tmp-99999"
    shutil.copytree(final, half)
    (half / ".metadata").unlink()
    one = subprocess.run(
        [GRPOD, "run", "--run-dir", str(run_dir), "--max-steps", str(last + 4)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    restored = events(one.stdout + one.stderr, "restored")[0]
    assert restored["saved_world"] == 2 and "model, optimizer" in restored["kept"], restored
    started = events(one.stdout + one.stderr, "started")[0]
    assert started["resumed_from"] == last + 1 and started["rerun_through"] >= last + 2
    assert not half.exists()

    # export consolidates the 2-rank shards into one Hugging Face directory
    hf = tmp_path / "hf"
    exported = subprocess.run(
        [GRPOD, "export", "--run-dir", str(run_dir), "--step", str(last + 1), str(hf)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert exported.returncode == 0, exported.stderr[-2000:]
    weights = load_file(str(hf / "model.safetensors"))
    engine = Engine(EngineConfig.model_validate({**ENGINE, "threads": 1}))
    initial = {n: t.clone() for n, t in engine.model.state_dict().items()}
    engine.load_checkpoint(final)  # one process reads the DCP checkpoint unsharded
    state = engine.model.state_dict()
    assert weights and all(torch.equal(t, state[n]) for n, t in weights.items())
    assert any(not torch.equal(t, initial[n]) for n, t in weights.items())  # trained weights

    # the prompt ledger: every prompt of every step once, across the kill, the resumes and the
    # change of world size; a 2-rank step's prompts name the rank that trained each
    fsck = subprocess.run(
        [GRPOD, "fsck", "--run-dir", str(run_dir), "--json"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    ledger = json.loads(fsck.stdout)["ledger"]
    assert ledger["missing"] == ledger["duplicated"] == [] and ledger["last_step"] == last + 3
    with sqlite3.connect(run_dir / "grpod.sqlite") as db:
        ranks = db.execute(
            "SELECT rank FROM prompt_ledger WHERE step = 0 AND NOT superseded ORDER BY prompt_id"
        ).fetchall()
    assert [r for (r,) in ranks] == [0, 0, 1, 1]


def _short_campaign(
    tmp_path: Path, engine: dict, steps: int, expect: int = 0, **sections: dict
) -> tuple[Path, str]:
    """A campaign under the agent to its end (exit `expect`): its run dir and its output."""
    config = write_config(
        tmp_path / "grpod.toml",
        {
            "engine": {**TINY_ENGINE, "micro_batch_rows": 1, **engine},
            "daemon": {"metrics_port": 0, "checkpoint_every": 2},
            **sections,
        },
    )
    run_dir, temp = tmp_path / "run", tmp_path / "tmp"
    temp.mkdir()
    args = ["--config", str(config), "--run-dir", str(run_dir), "--max-steps", str(steps)]
    env = {**ENV, "TMPDIR": str(temp)}
    done = subprocess.run(launcher(*args), env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == expect, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    # torch's agent's directory for the ranks' error files goes with the job
    assert not list(temp.glob("torchelastic_*")), list(temp.iterdir())
    return run_dir, done.stdout + done.stderr


def test_two_nodes_on_loopback_one_rank_each_share_the_run_dir(tmp_path) -> None:
    """Two agents with torchrun's rendezvous options (`--nnodes 2`, c10d on loopback), one
    rank each, one run dir: a 2-rank job whose ranks are on different "nodes" (each node's
    metrics files apart); `parallel = "none"`: a replica per rank, rank 0 records its own."""
    config = write_config(
        tmp_path / "grpod.toml",
        {
            "engine": {**TINY_ENGINE, "micro_batch_rows": 1, "parallel": "none"},
            "daemon": {"metrics_port": 0, "checkpoint_every": 2},
        },
    )
    run_dir, port = tmp_path / "run", free_port()
    rendezvous = ["--nnodes", "2", "--rdzv-backend", "c10d"]
    rendezvous += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "loopback"]
    args = [GRPOD, "run", "--nproc-per-node", "1", *rendezvous, "--config", str(config)]
    args += ["--run-dir", str(run_dir), "--max-steps", "2"]
    nodes = [
        subprocess.Popen(args, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:]
    started = events(outputs[0][0] + outputs[1][0], "started")
    assert sorted(started) == [0, 1]
    assert {p.name for p in (run_dir / "prometheus").iterdir()} == {"node-0", "node-1"}
    with sqlite3.connect(run_dir / "grpod.sqlite") as db:
        steps = db.execute("SELECT step, report_json FROM steps ORDER BY step").fetchall()
        (rows,) = db.execute("SELECT count(*) FROM step_ranks").fetchone()
    assert [s for s, _ in steps] == [0, 1] and rows == 0
    for _, text in steps:
        report = json.loads(text)
        assert report["world_size"] == 1
        assert report["valid_tokens"] == report["expected_valid_tokens"]


def test_a_ddp_lora_campaign_a_guard_halts_exits_3_and_replays(tmp_path) -> None:
    """LoRA adapters under `ddp` (only their gradients all-reduced). Steps 1 and 2 lose their
    loss to NaN (a drill): two flushes in a row are a HALT on every rank (the verdict is
    max-reduced), after a collective checkpoint; the agent exits 3, which the unit's
    RestartPreventExitStatus keeps down. `device = "auto"`: each rank's CUDA device, here (no
    CUDA) the CPU with gloo, as in one process."""
    pytest.importorskip("peft")
    run_dir, text = _short_campaign(
        tmp_path,
        {"parallel": "ddp", "device": "auto", "faults": {"nan_loss_steps": [1, 2]}},
        8,
        expect=3,
        guards={"halt_after_consecutive_flushes": 2},
        **{"engine.lora": {"rank": 4, "alpha": 8.0}},
    )
    stopped = events(text, "stopped")
    assert [stopped[r]["exit_code"] for r in (0, 1)] == [3, 3]
    halted_at = stopped[0]["next_step"]
    checkpoint = run_dir / "checkpoints" / f"step-{halted_at:08d}"
    assert {p.name for p in checkpoint.glob("rank-*")} == {"rank-0", "rank-1"}
    assert "grpod run: the job exits 3" in text
    # grpod's lines only: no DDP deprecation at start, no torch elastic W/E lines at the HALT
    assert "FutureWarning" not in text and not re.search(r"^[IWE]\d{4} ", text, re.M), text
    assert {p.name for p in (checkpoint / "rank-0").iterdir()} >= {"state.json"}
    with sqlite3.connect(run_dir / "grpod.sqlite") as db:
        outcomes = db.execute("SELECT step, outcome FROM steps ORDER BY step").fetchall()
        (report,) = db.execute("SELECT report_json FROM steps WHERE step = 0").fetchall()[0]
        ranks = db.execute("SELECT rank, valid_tokens FROM step_ranks WHERE step = 0").fetchall()
    assert outcomes[-2:] == [(1, "flushed"), (2, "flushed")]
    report = json.loads(report)
    assert report["world_size"] == 2 and sorted(ranks) == [
        (r["rank"], r["valid_tokens"]) for r in report["rank_reports"]
    ]
    assert report["global_valid_tokens"] == sum(v for _, v in ranks)
    # one process outside torchrun: the ddp config runs as "none", rank 1's part alone
    replay = ["replay", "--run-dir", str(run_dir), "--step", "0", "--json"]
    result = replay_result([GRPOD, *replay, "--rank", "1"])
    assert result["reproduced"] is True and result["replayed"]["valid_tokens"] == dict(ranks)[1]
    # the whole 2-rank step in one process: another reduction order, a stated tolerance
    result = replay_result([GRPOD, *replay])
    topology = "(recorded on 2 ranks, replayed in 1 process: reduction order differs)"
    assert result["reproduced"] in (True, f"within 1e-6 {topology}"), result


def test_a_refusal_on_one_rank_is_every_ranks_one_line_and_exit_2(tmp_path) -> None:
    """Local rank 0 cannot bind the metrics port (only the ranks can know): every rank says one
    line and exits 2 together, before anything is created; the agent exits 2."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(
            tmp_path / "grpod.toml", {"engine": TINY_ENGINE, "daemon": {"metrics_port": port}}
        )
        run_dir = tmp_path / "run"
        args = launcher("--config", str(config), "--run-dir", str(run_dir))
        done = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("grpod run: error:")]
    assert sorted(lines) == sorted(
        [
            f"grpod run: error: daemon.metrics_port: cannot bind 127.0.0.1:{port}: "
            "Address already in use",
            f"grpod run: error: rank 0: daemon.metrics_port: cannot bind 127.0.0.1:{port}: "
            "Address already in use",
        ]
    ), done.stderr
    assert "Traceback" not in done.stderr and not run_dir.exists()


STAND_IN_SERVER = """#!/bin/sh
# a vllm_server_python that preflight finds vLLM in, and whose server dies while starting
[ "$1" = "-c" ] && exit 0
echo "(APIServer pid=$$) INFO [api_server.py:1] vLLM API server starting" >&2
echo "Traceback (most recent call last):" >&2
echo "RuntimeError: stand-in server: no device to start on" >&2
echo "(APIServer pid=$$) WARNING [shutdown] force killing remaining process EngineCore" >&2
exit 1
"""


def test_a_node_server_that_dies_while_starting_is_every_ranks_line_and_exit_1(
    tmp_path,
) -> None:
    """vllm-server under torchrun: local rank 0 starts the node's server, which dies while
    starting. Every rank says one line naming its exception (rank 1: that it was rank 0's),
    the agent exits 1 (not the input's fault: systemd restarts it), and nothing is created."""
    python = tmp_path / "python"
    python.write_text(STAND_IN_SERVER)
    python.chmod(0o755)
    engine = {**TINY_ENGINE, "rollout_backend": "vllm-server", "vllm_server_python": str(python)}
    config = write_config(
        tmp_path / "grpod.toml",
        {"engine": engine, "daemon": {"metrics_port": free_port(), "log_format": "json"}},
    )
    run_dir = tmp_path / "run"
    args = launcher("--config", str(config), "--run-dir", str(run_dir), "--max-steps", "2")
    done = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    died = (
        "exited with status 1 while starting: RuntimeError: stand-in server: no device to start on"
    )
    lines = [line for line in done.stderr.splitlines() if line.startswith("grpod run: error:")]
    ranks = [line for line in lines if died in line]
    assert len(ranks) == 2, done.stderr[-6000:]
    assert sum("(on local rank 0, which runs the node's rollout server)" in x for x in ranks) == 1
    assert any("exit codes: rank 0 1, rank 1 1" in line for line in done.stderr.splitlines())
    assert not any(x.startswith("Traceback") for x in done.stderr.splitlines()), done.stderr
    assert not run_dir.exists()  # the server starts before the run dir is created


def test_lora_under_fsdp2_stops_resumes_replays_and_exports(tmp_path) -> None:
    """LoRA adapters under `fsdp2` (the frozen base sharded with them): SIGTERM checkpoints
    every rank's shards, a resume continues from them, the resumed step replays under
    torchrun bit-exactly and both exports read the checkpoint. (LoRA under `ddp`: the HALT
    drill above, checkpoint and replays included.)"""
    pytest.importorskip("peft")
    parallel = "fsdp2"
    config = write_config(
        tmp_path / "grpod.toml",
        {
            "engine": {**TINY_ENGINE, "micro_batch_rows": 1, "parallel": parallel, "lr": 1e-2},
            "engine.lora": {"rank": 4, "alpha": 8.0},
            "daemon": {"metrics_port": 0, "checkpoint_every": 100},
        },
    )
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    with _agent(launcher("--config", str(config), "--run-dir", str(run_dir)), log, ENV) as agent:
        _wait(agent, lambda: _status_step(run_dir) >= 1, "step 1 in status.json")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=GRACE_SECONDS + 60) == 0, log.read_text()[-3000:]
    stopped = events(log.read_text(), "stopped")
    stop_step = stopped[0]["next_step"]
    assert [stopped[r]["exit_code"] for r in (0, 1)] == [0, 0]
    checkpoint = run_dir / "checkpoints" / f"step-{stop_step:08d}"
    assert (checkpoint / ".metadata").is_file()
    assert {p.name for p in checkpoint.glob("rank-*")} == {"rank-0", "rank-1"}

    args = launcher("--run-dir", str(run_dir), "--max-steps", str(stop_step + 1))
    resumed = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    started = events(resumed.stdout, "started")
    assert [started[r]["resumed_from"] for r in (0, 1)] == [stop_step, stop_step]

    step = ["--run-dir", str(run_dir), "--step", str(stop_step), "--json"]
    result = replay_result(torchrun("replay", *step, logs=tmp_path / "tr"), timeout=180)
    assert result["reproduced"] is True, result

    for kind in (["--adapter"], []):
        out = tmp_path / ("adapter" if kind else "merged")
        done = subprocess.run(
            [GRPOD, "export", "--run-dir", str(run_dir), *kind, str(out)],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert any("lora_B" in n and t.abs().sum() > 0 for n, t in adapter.items())  # trained
    assert not any("lora_" in n for n in load_file(str(tmp_path / "merged/model.safetensors")))
