"""grpod's agent (daemon/launcher.py) without a job: its exit-status table, its notify channel,
torchrun's options passed through, and bad input refused before any rank starts. The real
launches are in tests/daemon/test_torchrun.py."""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from grpod.daemon import launcher
from grpod.daemon.commands.run import register
from grpod.daemon.notify import Notifier
from tests.daemon.helpers import (
    TINY_ENGINE,
    NotifySocket,
    cli,
    wait_until,
    write_config,
)

TERM, INT = signal.SIGTERM, signal.SIGINT


def test_the_jobs_exit_status_from_its_ranks() -> None:
    status = launcher.job_status
    assert status({}, []) == 0  # every rank 0 (ranks absent exited 0)
    assert status({}, [TERM]) == 0  # stopped by SIGTERM: checkpointed, exit 0
    assert status({0: 3, 1: 3}, []) == 3  # HALT
    assert status({1: 3, 0: -15}, []) == 3  # a HALTed peer's teardown is still a HALT
    assert status({0: 2, 1: -9}, []) == 2  # bad input on any rank
    assert status({1: -9, 0: 1}, []) == 1  # a crashed rank
    assert status({0: -15}, []) == 1  # killed by a signal the agent did not forward
    assert status({0: -15, 1: -15}, [TERM]) == 0  # the stop came before their handlers
    assert status({0: 143, 1: 143}, [TERM, TERM]) == 143  # a second SIGTERM: 128 + 15
    assert status({0: 130, 1: -15}, [INT, INT]) == 130
    assert status({0: 3}, [TERM, TERM]) == 3  # HALT's checkpoint was already under way


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["run", *argv])


def _config(args: argparse.Namespace) -> tuple:
    """`launch_config`, less the directory torch makes for it (the agent removes it)."""
    config, entrypoint, entry_args = launcher.launch_config(args)
    made = launcher.torch_log_dir(config)
    assert made and Path(made).name.startswith("torchelastic_") and Path(made).is_dir()
    shutil.rmtree(made)
    return config, entrypoint, entry_args


def test_the_agent_removes_only_the_log_dir_torch_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = _args("--nproc-per-node", "2", "--config", "g.toml")
    _config(args)  # one in the temporary directory, torch's
    monkeypatch.setenv("PET_LOG_DIR", str(tmp_path / "logs"))  # torchrun's --log-dir
    config, _, _ = launcher.launch_config(args)
    assert config.logs_specs.root_log_dir == str(tmp_path / "logs")
    assert launcher.torch_log_dir(config) is None


def test_torchruns_options_pass_through_and_the_ranks_run_grpod_run() -> None:
    args = _args("--nproc-per-node", "2", "--config", "g.toml", "--max-steps", "5")
    assert launcher.launching(args)
    config, entrypoint, entry_args = _config(args)
    assert (config.nproc_per_node, config.min_nodes, config.max_nodes) == (2, 1, 1)
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "localhost:0"
    assert config.max_restarts == 0 and config.signals_to_handle == "SIGQUIT"
    assert entrypoint == sys.executable
    assert entry_args == [
        *("-u", "-m", "grpod.daemon.cli", "run"),
        *("--config", "g.toml", "--max-steps", "5"),
    ]
    two = _args(
        "--nproc-per-node", "8", "--nnodes", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "head:29400", "--rdzv-id", "campaign-7",
    )  # fmt: skip
    config, _, _ = _config(two)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 8)
    assert (config.rdzv_endpoint, config.run_id) == ("head:29400", "campaign-7")
    static = _args(
        "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.0.0.1", "--master-port", "29500",
    )  # fmt: skip
    config, _, _ = _config(static)
    assert config.rdzv_backend == "static" and config.rdzv_configs["rank"] == 1
    assert config.rdzv_endpoint == "10.0.0.1:29500"
    assert not launcher.launching(_args("--config", "g.toml"))


def test_the_channel_tells_systemd_what_every_rank_says(tmp_path: Path) -> None:
    systemd = NotifySocket(tmp_path / "notify.sock")
    agent = Notifier({"NOTIFY_SOCKET": str(systemd.path)})
    channel = launcher.RankChannel(agent, local_ranks=2)
    ranks = [
        Notifier({"NOTIFY_SOCKET": channel.notify_socket, "GRPOD_LAUNCHER": "1", "LOCAL_RANK": r})
        for r in "01"
    ]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ranks[0].ready("ready; next step 0")
        ranks[0].watchdog()
        channel.forward(TERM)  # before rank 1 registered: it gets the signal as it does
        ranks[1].send(MAINPID=sleeper.pid)
        assert sleeper.wait(timeout=30) == -TERM
        ranks[1].ready("ready; next step 0")
        ranks[1].watchdog()  # both ranks pinged: one WATCHDOG=1
        ranks[1].status("rank 1's status is not the job's")
        ranks[0].status("step 0 done")
        ranks[1].extend_timeout(90)
        ranks[0].stopping("stopped: by SIGTERM")
        ranks[1].stopping("stopped: by SIGTERM")

        def told() -> bool:
            return systemd.fields("STOPPING") == ["1"]

        wait_until(told, "STOPPING")
    finally:
        sleeper.kill()
        channel.close()
        systemd.close()
    assert systemd.messages[0] == "READY=1\nSTATUS=2 ranks up; ready; next step 0"
    assert systemd.fields("WATCHDOG").count("1") == 2  # the pair's, and with EXTEND_TIMEOUT
    assert systemd.fields("STATUS")[1:] == ["step 0 done", "rank 0: stopped: by SIGTERM"]
    assert systemd.fields("EXTEND_TIMEOUT_USEC") == ["90000000"]
    assert systemd.fields("GRPOD_RANK") == []


@pytest.mark.slow  # a `grpod run` subprocess
def test_bad_input_is_refused_by_the_agent_before_any_rank_starts(tmp_path: Path) -> None:
    """3 groups over 2 ranks: one line from the agent, exit 2, no rank, nothing created."""
    config = write_config(
        tmp_path / "grpod.toml", {"engine": {**TINY_ENGINE, "prompts_per_step": 3}}
    )
    args = ["--nproc-per-node", "2", "--config", str(config), "--run-dir", "run"]
    temp = tmp_path / "tmp"
    temp.mkdir()
    done = cli("run", *args, cwd=tmp_path, timeout=120, env={"TMPDIR": str(temp)})
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "grpod run: error: engine.prompts_per_step: 3 groups do not split evenly over 2 ranks"
    ]
    assert done.stdout == "" and not (tmp_path / "run").exists()
    assert not list(temp.iterdir())  # torch's agent's log directory included


@pytest.mark.slow  # a `grpod run` subprocess
def test_a_launcher_option_torchrun_refuses_is_one_line(tmp_path: Path) -> None:
    args = ["--nproc-per-node", "2", "--nnodes", "2:1", "--run-dir", "run"]
    done = cli("run", *args, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("grpod run: error: launcher: ")
    assert not (tmp_path / "run").exists()
