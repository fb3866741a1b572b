"""`grpod run --nproc-per-node N ...`: grpod's own agent over torch's elastic launcher.

The job is torchrun's (`torch.distributed.run`'s own argument parser and `config_from_args`,
run by `elastic_launch`: rendezvous, the workers' environment, the teardown of a job whose
rank failed), with what a service needs that torchrun does not do:

- the exit status is grpod's for the job (`job_status`): every rank 0 -> 0, any HALT -> 3, bad
  input on any rank -> 2, a rank that crashed -> 1, a second stop signal -> 128+n; one line on
  stderr, never a traceback;
- SIGTERM / SIGINT / SIGHUP are forwarded to every rank (torch's own handlers are not
  installed: `signals_to_handle` is SIGQUIT alone), and the agent waits for the ranks' agreed
  stop and checkpoint however long it takes (systemd's `TimeoutStopSec` bounds it), not
  torchrun's 30 s before a SIGKILL;
- it speaks sd_notify itself (`RankChannel`): each rank's `NOTIFY_SOCKET` is the agent's own
  socket, and the agent tells systemd READY once every local rank is up, WATCHDOG each time
  every rank has pinged again (a hung rank stops them), rank 0's STATUS, EXTEND_TIMEOUT while
  they checkpoint and STOPPING, so the unit keeps `NotifyAccess=main`.

Before it spawns anything the agent checks what is cheap to know (`resolve_plan` and
`preflight`: the config, the run dir, the model dir, the task and reward) so that bad input is
one line, exit 2, no rank started and nothing created.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import threading
import uuid
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

from grpod.base.oneline import one_line, say
from grpod.daemon.errors import ConfigError
from grpod.daemon.exitcodes import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_HALT,
    EXIT_OK,
    exit_by_signal,
)
from grpod.daemon.notify import Notifier

# torchrun's rendezvous options, passed through as torchrun spells them
PASSED_THROUGH = (
    ("--nnodes", "nnodes", "N or MIN:MAX nodes (torchrun's)"),
    ("--node-rank", "node_rank", "this node's rank (static rendezvous)"),
    ("--rdzv-backend", "rdzv_backend", "rendezvous backend: static (default) or c10d"),
    ("--rdzv-endpoint", "rdzv_endpoint", "HOST:PORT of the rendezvous"),
    ("--rdzv-id", "rdzv_id", "the job's id, the same on every node"),
    ("--rdzv-conf", "rdzv_conf", "KEY=VALUE,... for the rendezvous"),
    ("--master-addr", "master_addr", "rank 0's host (static rendezvous)"),
    ("--master-port", "master_port", "rank 0's port (static rendezvous)"),
)
LAUNCHER_ENV = "GRPOD_LAUNCHER"  # set in the ranks' environment: the agent's pid
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def add_options(parser: argparse.ArgumentParser) -> None:
    """`grpod run`'s launcher options: `--nproc-per-node` and torchrun's rendezvous ones."""
    group = parser.add_argument_group("launcher (torchrun's options; grpod is the agent)")
    group.add_argument(
        "--nproc-per-node",
        metavar="N",
        help="start N ranks on this node under grpod's agent (one per GPU)",
    )
    group.add_argument(
        "--standalone", action="store_true", help="one node, a local rendezvous (the default)"
    )
    for flag, dest, text in PASSED_THROUGH:
        group.add_argument(flag, dest=dest, metavar=dest.split("_")[-1].upper(), help=text)


def launching(args: argparse.Namespace) -> bool:
    """True for the agent (`--nproc-per-node` given, not already a torchrun worker)."""
    return args.nproc_per_node is not None and "TORCHELASTIC_RUN_ID" not in os.environ


def rank_args(args: argparse.Namespace) -> list[str]:
    """The `grpod run` arguments each rank runs with (the launcher's own left out)."""
    out = ["run"]
    for flag, value in (
        ("--config", args.config),
        ("--run-dir", args.run_dir),
        ("--max-steps", args.max_steps),
        ("--linger", args.linger),
    ):
        if value is not None:
            out += [flag, str(value)]
    return out


def launch_config(args: argparse.Namespace) -> tuple[Any, str, list[str]]:
    """(LaunchConfig, entrypoint, its args) through torchrun's own parser and
    `config_from_args`: no restarts (systemd restarts), torch's signal handlers off."""
    from torch.distributed import run as torchrun

    argv = ["--nproc-per-node", str(args.nproc_per_node)]
    for flag, dest, _ in PASSED_THROUGH:
        if getattr(args, dest) is not None:
            argv += [flag, str(getattr(args, dest))]
    argv += ["--max-restarts", "0", "--signals-to-handle", "SIGQUIT"]
    targs = torchrun.get_args_parser().parse_args(
        [*argv, "--module", "grpod.daemon.cli", *rank_args(args)]
    )
    _, max_nodes = torchrun.parse_min_max_nnodes(targs.nnodes)
    local = not targs.rdzv_endpoint and targs.master_port is None and max_nodes == 1
    if args.standalone or (targs.rdzv_backend == "static" and local):
        # as torchrun's `run()`: one node, a c10d rendezvous on a free local port
        targs.rdzv_backend, targs.rdzv_endpoint = "c10d", "localhost:0"
        targs.rdzv_id = str(uuid.uuid4())
    if targs.master_port is None:
        targs.master_port = 29500
    return torchrun.config_from_args(targs)


def torch_log_dir(config: Any) -> str | None:
    """The `torchelastic_*` directory torch's agent made in the temporary directory for the
    job's error files, which it never removes (None when torchrun's `--log-dir`, here
    `PET_LOG_DIR`, names the user's own)."""
    return None if os.environ.get("PET_LOG_DIR") else str(config.logs_specs.root_log_dir)


def discard_torch_log_dir(config: Any) -> None:
    made = torch_log_dir(config)
    if made:
        shutil.rmtree(made, ignore_errors=True)


def job_status(codes: Mapping[int, int], stops: Sequence[int]) -> int:
    """grpod's exit status of a job from its ranks' exit codes (`codes`: rank -> code, negative
    when a signal killed it; ranks absent exited 0) and the stop signals the agent forwarded."""
    values = set(codes.values())
    if EXIT_HALT in values:
        return EXIT_HALT
    if EXIT_BAD_INPUT in values:
        return EXIT_BAD_INPUT
    if len(stops) >= 2 and exit_by_signal(stops[1]) in values:
        return exit_by_signal(stops[1])
    # a rank the forwarded stop killed before it took over its signals had started nothing
    stopped = {-s for s in stops[:1]}
    return EXIT_FAILURE if values - {EXIT_OK} - stopped else EXIT_OK


class RankChannel:
    """The agent's end of its ranks' sd_notify: an abstract datagram socket they send to (each
    message tagged with the sender's local rank), read on a thread, and what it means for the
    agent's own `Notifier` (systemd). It also knows the ranks' pids, to forward signals."""

    def __init__(self, notifier: Notifier, local_ranks: int) -> None:
        self.notifier, self.local_ranks = notifier, local_ranks
        self._name = f"grpod-launcher-{os.getpid()}-{secrets.token_hex(4)}"
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._socket.bind("\0" + self._name)
        self._socket.settimeout(0.2)
        self._lock = threading.RLock()  # RLock: a second signal may interrupt a forward
        self.pids: dict[int, int] = {}
        self.ready: set[int] = set()
        self._pinged: set[int] = set()
        self._signals: list[int] = []  # forwarded so far; replayed to a rank that registers late
        self._stopping = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="grpod-notify", daemon=True)
        self._thread.start()

    @property
    def notify_socket(self) -> str:
        return "@" + self._name

    def forward(self, signum: int) -> None:
        """Send `signum` to every rank that registered (and to later ones as they do)."""
        with self._lock:
            self._signals.append(signum)
            for pid in self.pids.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

    def stopping(self, status: str) -> None:
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self.notifier.stopping(status)

    def handle(self, fields: Mapping[str, str]) -> None:
        """One datagram of local rank `GRPOD_RANK`."""
        rank = int(fields.get("GRPOD_RANK", "-1"))
        with self._lock:
            if "MAINPID" in fields:
                pid = self.pids[rank] = int(fields["MAINPID"])
                for signum in self._signals:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signum)
            if "EXTEND_TIMEOUT_USEC" in fields:  # a checkpoint or a model load: alive
                self.notifier.send(EXTEND_TIMEOUT_USEC=fields["EXTEND_TIMEOUT_USEC"], WATCHDOG=1)
            if fields.get("READY") == "1" and rank not in self.ready:
                self.ready.add(rank)
                if len(self.ready) == self.local_ranks:
                    self.notifier.ready(f"{self.local_ranks} ranks up; {fields.get('STATUS', '')}")
            elif fields.get("STOPPING") == "1":
                self.stopping(f"rank {rank}: {fields.get('STATUS', 'stopping')}")
            elif "STATUS" in fields and rank == 0:
                self.notifier.status(fields["STATUS"])
            if fields.get("WATCHDOG") == "1":
                self._pinged.add(rank)
                if len(self._pinged) == self.local_ranks:  # every rank has stepped again
                    self._pinged.clear()
                    self.notifier.send(WATCHDOG=1)

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._socket.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            lines = data.decode(errors="replace").split("\n")
            fields = dict(line.split("=", 1) for line in lines if "=" in line)
            with contextlib.suppress(ValueError):
                self.handle(fields)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        self._socket.close()


def precheck(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    """What bad input can be known before any rank starts (EngineError / ConfigError -> 2):
    the config, the run dir (a live run holding it too) and `preflight` over the job's world."""
    from grpod.daemon.lock import RunDirLock
    from grpod.daemon.rundir import resolve_plan
    from grpod.engine.grpo.preflight import preflight

    plan = resolve_plan(args.config, args.run_dir, overrides)
    if plan.resume:
        RunDirLock.acquire(plan.run_dir.path).release()  # another live run: its pid named
    nodes = str(args.nnodes or "1")
    world = per_node = None
    if ":" not in nodes and str(args.nproc_per_node).isdigit():
        per_node = int(args.nproc_per_node)
        world = int(nodes) * per_node
    preflight(plan.config.engine, world=world, per_node=per_node)


# torch's agent logs its own W/E lines (the OMP_NUM_THREADS banner, "failed (exitcode: 3)",
# the workers it stops) on the stderr that is grpod's one line per refusal or exit
TORCH_ELASTIC_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic")


class _NotTorchElastic(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(TORCH_ELASTIC_LOGGERS)


def quiet_torch_elastic() -> None:
    """Keep torch's elastic agent off stderr: grpod says what the job did (`job_status`).
    Its modules set their loggers' levels as they are imported, so the records are dropped
    where torch writes them: the handlers of their ancestors, up to one that does not
    propagate (torch's logging gives `torch.distributed` its own)."""
    import torch  # noqa: F401 (installs those handlers)

    drop = _NotTorchElastic()
    for name in TORCH_ELASTIC_LOGGERS:
        logger: logging.Logger | None = logging.getLogger(name)
        while logger is not None:
            for handler in logger.handlers:
                handler.addFilter(drop)
            logger = logger.parent if logger.propagate else None


def launch(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """Run the job under torch's elastic agent; grpod's exit status for it."""
    quiet_torch_elastic()
    try:
        config, entrypoint, entry_args = launch_config(args)
    except (ValueError, AssertionError, RuntimeError) as exc:  # torchrun's checks
        raise ConfigError(f"launcher: {exc}") from None
    try:
        precheck(args, overrides)
    except BaseException:  # refused: nothing is left behind, torch's directory included
        discard_torch_log_dir(config)
        raise
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    notifier = Notifier()
    channel = RankChannel(notifier, config.nproc_per_node)
    os.environ.update({"NOTIFY_SOCKET": channel.notify_socket, LAUNCHER_ENV: str(os.getpid())})
    os.environ.pop("WATCHDOG_PID", None)  # the agent's; the ranks ping the agent (<= 1/s)
    stops: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if signum in STOP_SIGNALS:
            stops.append(signum)
            if len(stops) == 1:
                channel.stopping(f"stopping: {signal.Signals(signum).name} sent to the ranks")
        channel.forward(signum)

    previous = {s: signal.signal(s, on_signal) for s in FORWARDED}
    codes: dict[int, int] = {}
    try:
        elastic_launch(config, entrypoint)(*entry_args)
    except ChildFailedError as exc:
        codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
    except Exception as exc:  # the rendezvous (a node that never came): not the input's
        say(f"grpod run: error: launcher: {one_line(exc)}")
        return EXIT_FAILURE
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        channel.close()
        discard_torch_log_dir(config)  # the ranks' error files are read into `codes` by now
    status = job_status(codes, stops)
    if status != EXIT_OK:
        exited = ", ".join(f"rank {r} {c}" for r, c in sorted(codes.items()))
        others = "; the others 0" if len(codes) < config.nproc_per_node else ""
        say(f"grpod run: the job exits {status} (exit codes: {exited}{others})")
    notifier.close()
    return status
