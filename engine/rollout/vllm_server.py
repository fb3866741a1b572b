"""A vLLM OpenAI server process and the HTTP client that talks to it (rollout_server.py in
this package samples through them).

`ServerProcess` starts the server in its own process group (a stop reaches its engine core and
workers), forwards its output line by line to a logger, and on Linux has it SIGTERMed when the
process that started it dies. `ServerClient` sends JSON over HTTP (TCP, or a Unix socket:
`unix:/path`, how grpod's own server listens) with one timeout per request;
every failure (an HTTP error, no answer in time, a refused or dropped connection, an answer that
is not JSON) is one `SamplerError` line naming the server, the route and what went wrong.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import getpass
import http.client
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpod.engine.errors import EngineError, SamplerError

HEALTH_POLL_SECONDS = 0.25
STOP_SECONDS = 30.0  # SIGTERM to the server's process group, then SIGKILL
EXIT_GRACE_SECONDS = 2.0  # after a failed request: how long an exiting server may take
GROUP_EXIT_SECONDS = 10.0  # at a stop, after the server's main process: the rest of its group
GROUP_POLL_SECONDS = 0.05
_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
# a Python traceback's last line (an exception's name and message), vLLM's process prefix
# allowed: what a server that died while starting died of
_EXCEPTION = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:[\w.]+\.)?\w*(?:Error|Exception): ")
_PR_SET_PDEATHSIG = 1
_USAGE_ERROR = re.compile(r"^[\w.-]+: error: (.+)$")  # argparse's last line, before exit 2


UNIX_PREFIX = "unix:"  # a server URL that is a Unix socket's path: unix:/run/x/vllm.sock


class ServerClient:
    """JSON over HTTP to one vLLM server (`http://host:port`, or `unix:/path` for a Unix
    socket); every failure is one `SamplerError` line. `api_key`: sent as a bearer token with
    every request (a user's own server's credential; never in a message)."""

    def __init__(self, url: str, timeout_seconds: float, api_key: str = "") -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout_seconds
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._base, self._open = self.url, urllib.request.urlopen
        if self.url.startswith(UNIX_PREFIX):
            opener = urllib.request.build_opener(
                urllib.request.ProxyHandler({}), _UnixSocketHandler(self.url[len(UNIX_PREFIX) :])
            )
            self._base, self._open = "http://localhost", opener.open
        # the explanation of a failure that the caller knows more about (the process exited)
        self.explain: Callable[[], str] = lambda: ""

    def post(self, route: str, body: dict[str, Any] | None = None) -> Any:
        """POST `body` as JSON to `route`; the decoded answer (None when it has no body)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self._base + route,
            data=data if data is not None else b"",
            headers={"Content-Type": "application/json", **self._headers},
            method="POST",
        )
        return self._send(route, request)

    def get(self, route: str, *, timeout: float | None = None) -> Any:
        request = urllib.request.Request(self._base + route, headers=self._headers)
        return self._send(route, request, timeout)

    def _send(self, route: str, request: urllib.request.Request, timeout: float | None = None):
        try:
            with self._open(request, timeout=timeout or self.timeout) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as exc:
            raise self.error(route, f"answered HTTP {exc.code}: {_error_text(exc)}") from None
        except TimeoutError:
            raise self.error(route, f"no answer within {timeout or self.timeout:g} s") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                raise self.error(route, f"no answer within {timeout or self.timeout:g} s") from None
            raise self.error(route, _reason(exc.reason)) from None
        except (ConnectionError, OSError) as exc:  # a reset or a closed socket mid-answer
            raise self.error(route, _reason(exc)) from None
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise self.error(route, f"answered something that is not JSON: {raw[:80]!r}") from None

    def error(self, route: str, what: str) -> SamplerError:
        extra = self.explain()
        return SamplerError(f"rollout server {self.url}: {route}: {what}{extra}")


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over the Unix socket at `socket_path` (the request's host is only its header)."""

    def __init__(self, socket_path: str, host: str, **kwargs: Any) -> None:
        super().__init__(host, **kwargs)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class _UnixSocketHandler(urllib.request.HTTPHandler):
    def __init__(self, socket_path: str) -> None:
        super().__init__()
        self.socket_path = socket_path

    def http_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(functools.partial(_UnixConnection, self.socket_path), req)


class ServerProcess:
    """A vLLM OpenAI server that grpod started: its own process group (a stop reaches its
    engine and workers), its output forwarded line by line to `logger`."""

    def __init__(self, argv: list[str], env: dict[str, str], logger: logging.Logger) -> None:
        self.argv = argv
        self.logger = logger
        self.last_lines: collections.deque[str] = collections.deque(maxlen=20)
        self.process = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        self._reader = threading.Thread(target=self._forward, name="vllm-server-log", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_status(self) -> int | None:
        return self.process.poll()

    def wait_exit(self, seconds: float) -> int | None:
        """The exit status, waiting up to `seconds` for it; None: still running."""
        try:
            return self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return None

    def wait_ready(self, client: ServerClient, timeout_seconds: float) -> None:
        """Until `/health` answers 200; a server that exits or is not up in time: SamplerError."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            status = self.exit_status()
            if status is not None:
                self._reader.join(timeout=5)  # its last lines say why
                refused = _USAGE_ERROR.match(self.last_lines[-1] if self.last_lines else "")
                if status == 2 and refused:  # argparse's: the config's fault, not a restart's
                    raise EngineError(
                        f"vllm_server_args: the vLLM server refused its arguments: "
                        f"{refused.group(1)}"
                    )
                raise SamplerError(
                    f"rollout server {client.url}: exited with status {status} while "
                    f"starting{self.last_error()}"
                )
            try:
                client.get("/health", timeout=5)
                return
            except SamplerError:
                if time.monotonic() >= deadline:
                    raise SamplerError(
                        f"rollout server {client.url}: not up within {timeout_seconds:g} s "
                        f"(vllm_server_start_timeout_seconds){self.last_error()}"
                    ) from None
            time.sleep(HEALTH_POLL_SECONDS)

    def last_error(self) -> str:
        """The server's last exception (a traceback's last line), else its last ERROR line,
        else its last line, for a failure's message."""
        lines = list(self.last_lines)
        raised = [line for line in lines if _EXCEPTION.match(line)]
        errors = [line for line in lines if _LEVEL.search(line[:80] or "") and "ERROR" in line]
        line = (raised or errors or lines or [""])[-1]
        return f": {line}" if line else ""

    def stop(
        self, timeout_seconds: float = STOP_SECONDS, grace_seconds: float = GROUP_EXIT_SECONDS
    ) -> None:
        """SIGTERM to the server's process group; once its main process has exited, what is
        left of the group gets `grace_seconds` to exit too; SIGKILL to what is left then, or
        after `timeout_seconds` if the main process is still there."""
        running = self.process.poll() is None
        with contextlib.suppress(ProcessLookupError):
            # a main process that died first (a crash, the OOM killer) leaves its engine core
            # running until it is told
            os.killpg(self.process.pid, signal.SIGTERM)
        if running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout_seconds)
        if self.process.poll() is not None:
            # the engine core finishing, then multiprocessing's resource tracker, which unlinks
            # the server's semaphores once every process of the group is gone: SIGKILLed
            # before that, it leaves them in /dev/shm
            wait_group_gone(self.process.pid, grace_seconds)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # its engine core and workers too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout_seconds)
        self._reader.join(timeout=5)
        wait_group_gone(self.process.pid, timeout_seconds)  # until its orphans are reaped too

    def _forward(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = " ".join(raw.split())
            if not line:
                continue
            self.last_lines.append(line)
            level = _LEVEL.search(line[:80])
            self.logger.log(getattr(logging, level.group(1)) if level else logging.INFO, line)


def wait_group_gone(pgid: int, seconds: float) -> None:
    """Until no process of group `pgid` is left, or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(GROUP_POLL_SECONDS)


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` is left."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# what torchrun (and grpod's agent) tell their ranks: a server one of them starts is no part
# of that job (vLLM reads RANK / WORLD_SIZE / MASTER_* for its own process group, and its
# prometheus-client would write into the ranks' multiprocess metrics directory)
TORCHRUN_ENV = (
    "PROMETHEUS_MULTIPROC_DIR",
    "prometheus_multiproc_dir",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


# glibc's malloc for a CPU server (`vllm_server_cpu_malloc = "retain"`): every push's reload
# allocates the model's layers anew and frees the old ones; with mmap off and no trimming the
# next push reuses that memory warm instead of faulting in fresh pages (bench/README)
RETAINING_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def server_env(
    cpu: bool = False, retain_memory: bool = True, temp_dir: Path | None = None
) -> dict[str, str]:
    """The server's environment: grpod's, less torchrun's, plus vLLM's settings (`cpu`: the
    server runs on the CPU; `retain_memory`: there, glibc's malloc keeps what it frees,
    unless grpod's environment tunes malloc itself; `temp_dir`: the server's temporary
    directory, removed with it: vLLM binds the ZMQ sockets between its API server and its
    engine core there, and its engine core's torch.distributed file store, which a stop
    leaves behind, goes there; in the shared temp dir they outlive every server)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")
    }
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache
    if temp_dir is not None:
        # torch's compile cache stays where it was (its default is under the temp dir)
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
        env["TMPDIR"] = env["VLLM_RPC_BASE_PATH"] = str(temp_dir)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # CPU: beside the trainer, unpinned
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the colocated sampler's setting
    if cpu:
        # vLLM's CPU platform runs a one-process executor only when this is 0 (else it
        # starts a worker process); the API server keeps its engine core in a process of
        # its own either way (server_argv: `--distributed-executor-backend uni`)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        tuned = any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES" for k in env)
        if retain_memory and not tuned:
            env.update(RETAINING_MALLOC)
    return env


def inductor_cache_dir() -> str:
    """torch inductor's default cache directory (`default_cache_dir` in torch 2.4-2.13)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(
        tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)
    )


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the server's process: SIGTERM when grpod's process dies (even by SIGKILL)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read() or b"{}")
        message = body.get("error", {}).get("message") or body.get("detail") or body
    except Exception:
        message = exc.reason
    return " ".join(str(message).split())[:200]


def _reason(reason: Any) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return " ".join(str(reason).split()) or type(reason).__name__


def short_json(answer: Any) -> str:
    """`answer` as one line of JSON, cut to 80 characters (for an error message)."""
    text = " ".join(json.dumps(answer, default=str).split())
    return text if len(text) <= 80 else text[:77] + "..."
