"""vLLM rollouts from a server process (`rollout_backend = "vllm-server"`).

The rollout runs in vLLM's OpenAI-compatible server, off the trainer's process: either one
that grpod starts and supervises (`ServerProcess`: its own process group, its output
forwarded line by line to the `vllm.server` logger, stopped with the engine; on Linux it also
dies with the process that started it), or an existing one named by `vllm_server_url`.

- **Weights** travel through the filesystem, as prime-rl's do: every push writes the
  trainer's tensors into one safetensors snapshot (a temporary directory, fsynced, renamed
  into place: never half-written under its name) in the sync directory, asks the server's
  workers to `reload_weights` from it (`/collective_rpc`; grpod starts the server with
  `VLLM_SERVER_DEV_MODE=1`, an existing one needs it too), removes the previous snapshot,
  then `/reset_prefix_cache`. The server must see the directory: same host, or a shared
  filesystem (`vllm_server_sync_dir`).
- **Completions** are requested by token ids (the server runs without a tokenizer), one
  `/v1/completions` request per completion, seeded as the colocated sampler seeds them, all
  in flight at once (the server batches them); ids come back as `token_id:N` with each
  sampled token's processed logprob, NaN and -inf kept. The weight-sync probe's two requests
  ride with the rollout's, as in the colocated sampler (`engine/rollout_vllm.py`).
- **Failures** are never retried here: a server that exited, refuses connections, does not
  answer a request within `vllm_server_timeout_seconds`, or answers something that is not
  what was asked, raises `SamplerError` with one line naming the server, the route and what
  went wrong. The daemon records the step's incident and exits 1 (not the input's fault:
  systemd restarts the unit and the next start resumes from the checkpoint).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import shutil
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from grpod.engine.config import EngineConfig
from grpod.engine.errors import SamplerError
from grpod.engine.rollout_vllm import CPU_KV_CACHE_BYTES, ServedModel, to_rollout, weights_to_push
from grpod.engine.torch_sampler import Rollout
from grpod.engine.weight_sync import CONTINUATION_TOKENS, ProbeScores, PushFaults
from grpod.fileio import atomic_dir

SERVED_NAME = "grpod-policy"  # the model's name in requests (its path changes with every push)
HEALTH_POLL_SECONDS = 0.25
STOP_SECONDS = 30.0  # SIGTERM to the server's process group, then SIGKILL
EXIT_GRACE_SECONDS = 2.0  # after a failed request: how long an exiting server may take
MAX_REQUESTS_IN_FLIGHT = 64
SNAPSHOT = "model.safetensors"
_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
_PR_SET_PDEATHSIG = 1


class ServerClient:
    """JSON over HTTP to one vLLM server; every failure is one `SamplerError` line."""

    def __init__(self, url: str, timeout_seconds: float) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout_seconds
        # the explanation of a failure that the caller knows more about (the process exited)
        self.explain: Callable[[], str] = lambda: ""

    def post(self, route: str, body: dict[str, Any] | None = None) -> Any:
        """POST `body` as JSON to `route`; the decoded answer (None when it has no body)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + route,
            data=data if data is not None else b"",
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        return self._send(route, request)

    def get(self, route: str, *, timeout: float | None = None) -> Any:
        return self._send(route, urllib.request.Request(self.url + route), timeout)

    def _send(self, route: str, request: urllib.request.Request, timeout: float | None = None):
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as answer:
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
        """The server's last error line (or last line), for a failure's message."""
        lines = list(self.last_lines)
        errors = [line for line in lines if _LEVEL.search(line[:80] or "") and "ERROR" in line]
        line = (errors or lines or [""])[-1]
        return f": {line}" if line else ""

    def stop(self, timeout_seconds: float = STOP_SECONDS) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after the timeout."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout_seconds)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # its engine core and workers too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout_seconds)
        self._reader.join(timeout=5)
        deadline = time.monotonic() + timeout_seconds  # until its orphans are reaped too
        while group_alive(self.process.pid) and time.monotonic() < deadline:
            time.sleep(HEALTH_POLL_SECONDS)

    def _forward(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = " ".join(raw.split())
            if not line:
                continue
            self.last_lines.append(line)
            level = _LEVEL.search(line[:80])
            self.logger.log(getattr(logging, level.group(1)) if level else logging.INFO, line)


class ServerSampler:
    """Rollouts from a vLLM server that takes the trainer's weights before every rollout;
    the same `push` / `sample` / `close` as the colocated `VLLMSampler`."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, probe_tokens: int) -> None:
        self.served = ServedModel(model, config, probe_tokens)
        self.probe_tokens, self.max_model_len = self.served.probe_tokens, self.served.max_model_len
        self.process: ServerProcess | None = None
        self._own_sync_dir = not config.vllm_server_sync_dir
        self.sync_dir = Path(
            config.vllm_server_sync_dir or tempfile.mkdtemp(prefix="grpod-vllm-sync-")
        )
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        self._snapshot: Path | None = None
        self._pushes = 0
        self._pool = ThreadPoolExecutor(MAX_REQUESTS_IN_FLIGHT, thread_name_prefix="vllm-request")
        url = config.vllm_server_url
        if not url:
            host = config.vllm_server_host
            port = config.vllm_server_port or _free_port(host)
            url = f"http://{host}:{port}"
        self.client = ServerClient(url, config.vllm_server_timeout_seconds)
        try:
            if config.vllm_server_url:
                self.client.get("/health")
            else:
                self.process = ServerProcess(
                    server_argv(config, self.served, url), server_env(), _server_logger()
                )
                self.client.explain = self._explain
                self.process.wait_ready(self.client, config.vllm_server_start_timeout_seconds)
        except BaseException:
            self.close()
            raise

    def push(self, model: torch.nn.Module, faults: PushFaults | None = None) -> None:
        """Write `model`'s weights into a new snapshot, have the server reload from it, then
        reset its prefix cache."""
        faults = faults or PushFaults()
        if faults.skip:
            return
        self._pushes += 1
        snapshot = self.sync_dir / f"weights-{self._pushes:08d}"
        with atomic_dir(snapshot, replace=True) as tmp:
            from safetensors.torch import save_file

            save_file(_unshared(weights_to_push(model, faults)), str(tmp / SNAPSHOT))
        answer = self.client.post(
            "/collective_rpc",
            {
                "method": "reload_weights",
                "kwargs": {"weights_path": str(snapshot)},
                "timeout": self.client.timeout,
            },
        )
        if not isinstance(answer, dict) or "results" not in answer:
            raise self.client.error("/collective_rpc", f"answered {_short(answer)} to a reload")
        previous, self._snapshot = self._snapshot, snapshot
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        if not faults.keep_prefix_cache:
            self.client.post("/reset_prefix_cache")

    def sample(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        eos_token_id: int | list[int],
        pad_token_id: int,
        seed: int,
        probe: list[int] | None = None,
    ) -> tuple[Rollout, ProbeScores | None]:
        """One completion per prompt, each request seeded from `seed` and its index, and the
        weight-sync probe's scores (`probe`): the colocated sampler's contract."""
        stop = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        bodies = [
            _completion(
                p,
                max_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=(seed + i) % (1 << 63),
                stop_token_ids=stop,
            )
            for i, p in enumerate(prompts)
        ]
        if probe is not None:
            common = dict(temperature=1.0, top_p=1.0, seed=seed, ignore_eos=True)
            continuation = min(CONTINUATION_TOKENS, max_new_tokens)
            bodies[:0] = [
                _completion(probe, max_tokens=continuation, **common),
                _completion(probe, max_tokens=1, prompt_logprobs=0, **common),
            ]
        answers = list(self._pool.map(self._complete, bodies))
        scores = None
        if probe is not None:
            scores = self._probe_scores(probe, answers[0], answers[1])
            answers = answers[2:]
        completions = [self._sampled(a) for a in answers]
        return to_rollout(completions, max_new_tokens, pad_token_id), scores

    def close(self) -> None:
        """Stop the server grpod started; remove the snapshots it was given."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.process is not None:
            self.process.stop()
        if self._own_sync_dir:
            shutil.rmtree(self.sync_dir, ignore_errors=True)
        elif self._snapshot is not None:
            shutil.rmtree(self._snapshot, ignore_errors=True)

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        answer = self.client.post("/v1/completions", body)
        if not isinstance(answer, dict) or not answer.get("choices"):
            raise self._garbage(f"{_short(answer)}, not a completion")
        return answer

    def _sampled(self, answer: dict[str, Any]) -> tuple[list[int], list[float]]:
        """A completion's sampled ids and logprobs (`token_id:N` tokens)."""
        try:
            logprobs = answer["choices"][0]["logprobs"]
            tokens = [int(str(t).removeprefix("token_id:")) for t in logprobs["tokens"]]
            values = [math_float(v) for v in logprobs["token_logprobs"]]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise self._garbage(
                f"a completion without its token ids and logprobs ({exc!r})"
            ) from None
        if len(values) != len(tokens):
            raise self._garbage(f"{len(tokens)} tokens with {len(values)} logprobs")
        return tokens, values

    def _probe_scores(self, probe: list[int], continued: dict, scored: dict) -> ProbeScores:
        tokens, values = self._sampled(continued)
        try:
            positions = scored["choices"][0]["prompt_logprobs"]
            prompt = [
                math_float(position[str(token)]["logprob"])
                for position, token in zip(positions[1:], probe[1:])
            ]
            details = (continued.get("usage") or {}).get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens") or 0)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise self._garbage(f"the probe's prompt logprobs missing ({exc!r})") from None
        if len(prompt) != len(probe) - 1:
            raise self._garbage(f"{len(prompt)} prompt logprobs for {len(probe)} probe tokens")
        return ProbeScores(tokens, prompt, values, cached)

    def _garbage(self, what: str) -> SamplerError:
        return self.client.error("/v1/completions", f"answered {what}")

    def _explain(self) -> str:
        """Why a request failed, when the server grpod started has exited (a connection
        reset can reach the client before the exit status does: a short wait for it)."""
        if self.process is None:
            return ""
        status = self.process.wait_exit(EXIT_GRACE_SECONDS)
        if status is None:
            return ""
        return f" (the server exited with status {status}{self.process.last_error()})"


def server_argv(config: EngineConfig, served: ServedModel, url: str) -> list[str]:
    """The command line of the server grpod starts for `config`."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    argv = [
        config.vllm_server_python or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(served.path),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        host,
        "--port",
        port,
        "--skip-tokenizer-init",  # requests carry token ids: the trainer's tokenizer is the one
        "--dtype",
        "bfloat16" if config.dtype == "bfloat16" else "float32",
        "--max-model-len",
        str(served.max_model_len),
        "--seed",
        str(config.seed),
        "--enable-prefix-caching",
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-prompt-tokens-details",  # the probe's cached tokens
    ]
    if config.vllm_kv_cache_bytes or not torch.cuda.is_available():
        # on CPU a gpu_memory_utilization would be a fraction of the machine's RAM
        bytes_ = config.vllm_kv_cache_bytes or CPU_KV_CACHE_BYTES
        argv += ["--kv-cache-memory-bytes", str(bytes_)]
    else:
        argv += ["--gpu-memory-utilization", str(config.vllm_gpu_memory_utilization)]
    if not torch.cuda.is_available():
        argv.append("--enforce-eager")  # no graph capture or compile on CPU
    return argv + list(config.vllm_server_args)


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` is left."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # CPU: beside the trainer, unpinned
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the colocated sampler's setting
    return env


def math_float(value: Any) -> float:
    """A JSON logprob as a float: NaN and infinities as the server wrote them."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"logprob {value!r}")
    return float(value)


def _unshared(weights: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every name with its own contiguous copy, as safetensors stores them: a tied head is
    written under both names (vLLM's layerwise reload leaves a tied name it is not sent
    holding stale values: measured 1.4 nats off on the tiny model)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in weights:
        tensor = tensor.detach().to("cpu").contiguous()
        out[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    return out


def _completion(prompt: list[int], **params: Any) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "logprobs": 0,  # the sampled token's own logprob
        "return_tokens_as_token_ids": True,
        **params,
    }


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _server_logger() -> logging.Logger:
    return logging.getLogger("vllm.server")


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


def _short(answer: Any) -> str:
    text = " ".join(json.dumps(answer, default=str).split())
    return text if len(text) <= 80 else text[:77] + "..."
