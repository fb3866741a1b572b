"""vLLM rollouts from a server process (`rollout_backend = "vllm-server"`).

The rollout runs in vLLM's OpenAI-compatible server, off the trainer's process: either one
that grpod starts and supervises (`engine/rollout/vllm_server.py`: its own process group, its output
forwarded line by line to the `vllm.server` logger, stopped with the engine; on Linux it also
dies with the process that started it), or an existing one named by `vllm_server_url`.

- **Who can reach it**: grpod's own server listens on a Unix socket (`--uds`) in a 0700
  temporary directory, and the pushed weights go to a 0700 temporary directory: no other user
  can drive its control routes (`/collective_rpc`, `/reset_prefix_cache`), sample from the
  policy, or put weights in its way (docs/SECURITY.md). A server named by `vllm_server_url`
  is the user's to protect; `vllm_server_api_key_env` names the variable holding its
  credential, sent as a bearer token with every request.
- **Weights** go into the running server in place (`vllm_server_push`, 'auto'): grpod starts
  its server with a worker extension (`engine/rollout/shared_weights.py`) that maps shared
  regions in the sync directory (/dev/shm): the rollout model's parameters live in one from the
  first push on (trained there, never copied for a push); every push asks the server's
  workers to load them through vLLM's own in-place reload
  (`/collective_rpc`; grpod starts the server with `VLLM_SERVER_DEV_MODE=1`), then
  `/reset_prefix_cache`. A server named by `vllm_server_url` takes snapshots instead, as
  prime-rl's do: every push writes one safetensors file (a new directory, removed after the
  next push) that its workers `reload_weights` from. Either way the server must see the sync
  directory: same host, or for snapshots a shared filesystem (`vllm_server_sync_dir`).
- **Completions** are requested by token ids (the server runs without a tokenizer), one
  `/v1/completions` request per completion, seeded as the colocated sampler seeds them, all
  in flight at once (the server batches them); ids come back as `token_id:N` with each
  sampled token's processed logprob, NaN and -inf kept. The weight-sync probe's two requests
  ride with the rollout's, as in the colocated sampler (`engine/rollout/rollout_vllm.py`).
- **Failures** are never retried here: a server that exited, refuses connections, does not
  answer a request within `vllm_server_timeout_seconds`, or answers something that is not
  what was asked, raises `SamplerError` with one line naming the server, the route and what
  went wrong. The daemon records the step's incident and exits 1 (not the input's fault:
  systemd restarts the unit and the next start resumes from the checkpoint).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from grpod.engine.config import EngineConfig
from grpod.engine.errors import EngineError, SamplerError
from grpod.engine.rollout.rollout_vllm import ServedModel, to_rollout, weights_to_push
from grpod.engine.rollout.sampler import Rollout, SamplingSettings
from grpod.engine.rollout.shared_weights import RPC_METHOD, SharedWeights, SharedWeightsWorker
from grpod.engine.rollout.sync_dir import SOCKET_PREFIX, OwnedDir, SyncDir
from grpod.engine.rollout.vllm_limits import BLOCK_TOKENS, CPU_KV_CACHE_BYTES
from grpod.engine.rollout.vllm_server import (
    EXIT_GRACE_SECONDS,
    UNIX_PREFIX,
    ServerClient,
    ServerProcess,
    server_env,
    short_json,
)
from grpod.engine.weight_sync import CONTINUATION_TOKENS, ProbeScores, PushFaults

SERVED_NAME = "grpod-policy"  # the model's name in requests (its path changes with every push)
MAX_REQUESTS_IN_FLIGHT = 64
SNAPSHOT = "model.safetensors"
SOCKET = "vllm.sock"
SHUTDOWN_SECONDS = 15  # under vllm_server.STOP_SECONDS, after which grpod SIGKILLs them all


class ServerSampler:
    """Rollouts from a vLLM server that takes the trainer's weights before every rollout;
    the same `push` / `sample` / `close` as the colocated `VLLMSampler`."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        probe_tokens: int,
        *,
        peer_of: str | None = None,
    ) -> None:
        """`peer_of`: the URL of the node's server that local rank 0 started or reached
        (under torchrun): this rank samples from it and never pushes (its leader does)."""
        platform = "cuda" if torch.cuda.is_available() else "cpu"  # a server grpod starts here
        self.served = ServedModel(model, config, probe_tokens, platform)
        self.probe_tokens, self.max_model_len = self.served.probe_tokens, self.served.max_model_len
        self.process: ServerProcess | None = None
        self.sync_dir: Path | None = None  # where the pushes' snapshots go (not a peer's)
        self._own: SyncDir | None = None
        if peer_of is None and config.vllm_server_sync_dir:
            self.sync_dir = Path(config.vllm_server_sync_dir)
            self.sync_dir.mkdir(parents=True, exist_ok=True)
        elif peer_of is None:  # two pushes' worth of room: the one being read and the next
            self._own = SyncDir(2 * _state_bytes(model))
            self.sync_dir = self._own.path
        self._snapshot: Path | None = None
        self._pushes = 0
        self._shared: SharedWeights | None = None  # in-place pushes (vllm_server_push)
        if self.sync_dir is not None and config.vllm_server_push_in_place:
            self._shared = SharedWeights(self.sync_dir)
        self._pool = ThreadPoolExecutor(MAX_REQUESTS_IN_FLIGHT, thread_name_prefix="vllm-request")
        url = peer_of or config.vllm_server_url
        self._socket_dir: OwnedDir | None = None  # 0700: grpod's own server's socket, its TMPDIR
        if not url:
            self._socket_dir = OwnedDir(SOCKET_PREFIX)
            url = f"{UNIX_PREFIX}{self._socket_dir.path / SOCKET}"
        try:
            key = os.environ.get(config.vllm_server_api_key_env, "")
            if config.vllm_server_api_key_env and not key:
                raise EngineError(
                    f"engine.vllm_server_api_key_env: ${config.vllm_server_api_key_env} is not set"
                )
            self.client = ServerClient(url, config.vllm_server_timeout_seconds, api_key=key)
            if peer_of is not None or config.vllm_server_url:
                self.client.get("/health")
            else:
                self.process = ServerProcess(
                    server_argv(config, self.served, url),
                    server_env(
                        cpu=not torch.cuda.is_available(),
                        retain_memory=config.vllm_server_cpu_malloc == "retain",
                        temp_dir=self._socket_dir.path if self._socket_dir else None,
                    ),
                    _server_logger(),
                )
                self.client.explain = self._explain
                self.process.wait_ready(self.client, config.vllm_server_start_timeout_seconds)
        except BaseException:
            self.close()
            raise

    def push(self, model: torch.nn.Module, faults: PushFaults | None = None) -> tuple[str, ...]:
        """Put `model`'s weights into the server (in place through shared memory, or a
        snapshot it reloads: `vllm_server_push`), then reset its prefix cache; returns the
        server's parameters an in-place push did not load (a snapshot's: not known, ())."""
        if self.sync_dir is None:
            raise EngineError("a peer rank pushed to its node's rollout server (local rank 0 does)")
        faults = faults or PushFaults()
        if faults.skip:
            return ()
        if self._shared is not None:
            self._shared.adopt(model)  # its parameters move into shared memory, once
        weights = weights_to_push(model, faults)
        unloaded: set[str] = set()  # a snapshot's reload says nothing of it
        if self._shared is not None:
            kwargs = self._shared.write(weights)
            manifest = kwargs["manifest"]
            results = self._rpc(RPC_METHOD, kwargs, "a shared-memory load")
            answers = [r if isinstance(r, dict) else {"tensors": r} for r in results]
            loaded = [a.get("tensors") for a in answers]
            if not loaded or any(n != len(manifest) for n in loaded):
                raise self.client.error(
                    "/collective_rpc",
                    f"loaded {loaded} tensors of a shared-memory push of {len(manifest)}",
                )
            unloaded = {name for a in answers for name in a.get("unloaded", ())}
        else:
            self._push_snapshot(weights)
        if not faults.keep_prefix_cache:
            self.client.post("/reset_prefix_cache")
        return tuple(sorted(unloaded))

    def _push_snapshot(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Write `weights` into a new snapshot and have the server reload from it. A snapshot
        is a transfer, read once by the server right after it is written: never fsynced (a
        crash loses nothing the checkpoints do not hold)."""
        assert self.sync_dir is not None
        self._pushes += 1
        snapshot = self.sync_dir / f"weights-{self._pushes:08d}"
        shutil.rmtree(snapshot, ignore_errors=True)  # a previous process's, in a given sync dir
        snapshot.mkdir(mode=0o700)
        from safetensors.torch import save_file

        save_file(_unshared(weights), str(snapshot / SNAPSHOT))
        self._rpc("reload_weights", {"weights_path": str(snapshot)}, "a reload")
        previous, self._snapshot = self._snapshot, snapshot
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)

    def _rpc(self, method: str, kwargs: dict[str, Any], what: str) -> list[Any]:
        """Run `method` on the server's workers (`/collective_rpc`); each worker's result."""
        body = {"method": method, "kwargs": kwargs, "timeout": self.client.timeout}
        answer = self.client.post("/collective_rpc", body)
        if not isinstance(answer, dict) or not isinstance(answer.get("results"), list):
            raise self.client.error("/collective_rpc", f"answered {short_json(answer)} to {what}")
        return answer["results"]

    @property
    def own_cores(self) -> bool:
        """Whether the server grpod started runs on CPU cores this process does not (its
        affinity and the trainer's are disjoint): then the check's trainer forward can run
        while the server samples, without the two fighting over cores. False for a server
        named by `vllm_server_url` (where it runs is not known here)."""
        if self.process is None:
            return False
        try:
            return os.sched_getaffinity(self.process.pid).isdisjoint(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # no such call here, or the server has exited
            return False

    def sample(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        probe: list[int] | None = None,
        beside: Callable[[], None] | None = None,
    ) -> tuple[Rollout, ProbeScores | None]:
        """One completion per prompt, each request seeded by `settings.request_seed`, and the
        weight-sync probe's scores (`probe`): the colocated sampler's contract. `beside` runs
        on this thread once every request is sent, while the server samples them."""
        bodies = [
            _completion(
                p,
                max_tokens=settings.max_new_tokens,
                temperature=settings.temperature,
                top_p=settings.top_p,
                seed=settings.request_seed(i),
                stop_token_ids=settings.stop_ids,
            )
            for i, p in enumerate(prompts)
        ]
        if probe is not None:  # cached, then fresh (prompt logprobs bypass the prefix cache)
            common = dict(temperature=0.0, top_p=1.0, seed=settings.seed, ignore_eos=True)
            common["max_tokens"] = min(CONTINUATION_TOKENS, settings.max_new_tokens)
            bodies[:0] = [
                _completion(probe, **common),
                _completion(probe, prompt_logprobs=0, **common),
            ]
        pending = self._pool.map(self._complete, bodies)  # every request in flight now
        if beside is not None:
            beside()
        answers = list(pending)
        scores = None
        if probe is not None:
            scores = self._probe_scores(probe, answers[0], answers[1])
            answers = answers[2:]
        completions = [self._sampled(a) for a in answers]
        return to_rollout(completions, settings.max_new_tokens, settings.pad_token_id), scores

    def close(self) -> None:
        """Stop the server grpod started; remove the snapshots it was given."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.process is not None:
            self.process.stop()
        if self._socket_dir is not None:
            self._socket_dir.close()
        self.served.close()
        if self._shared is not None:
            self._shared.close()
        if self._own is not None:
            self._own.close()
        elif self._snapshot is not None:
            shutil.rmtree(self._snapshot, ignore_errors=True)

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        answer = self.client.post("/v1/completions", body)
        if not isinstance(answer, dict) or not answer.get("choices"):
            raise self._garbage(f"{short_json(answer)}, not a completion")
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
        fresh, fresh_values = self._sampled(scored)
        return ProbeScores(tokens, prompt, values, cached, fresh, fresh_values)

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
    """The command line of the server grpod starts for `config`, listening on the Unix socket
    of `url` (`unix:/path`)."""
    argv = [
        config.vllm_server_python or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(served.path),
        "--served-model-name",
        SERVED_NAME,
        "--uds",
        url.removeprefix(UNIX_PREFIX),
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
        "--no-use-tqdm-on-load",  # its stderr is forwarded line by line: no progress bars
        # at a stop its engine core gets this long to finish by itself (at 0, vLLM's API
        # server SIGKILLs it at once, tearing down nothing)
        "--shutdown-timeout",
        str(SHUTDOWN_SECONDS),
    ]
    if config.vllm_kv_cache_bytes or not torch.cuda.is_available():
        # on CPU a gpu_memory_utilization would be a fraction of the machine's RAM
        bytes_ = config.vllm_kv_cache_bytes or CPU_KV_CACHE_BYTES
        argv += ["--kv-cache-memory-bytes", str(bytes_)]
    else:
        argv += ["--gpu-memory-utilization", str(config.vllm_gpu_memory_utilization)]
    if not torch.cuda.is_available():
        argv.append("--enforce-eager")  # no graph capture or compile on CPU
        # the model in the engine core's process (server_env lets vLLM's CPU build run it
        # there): a worker process of its own busy-waits a core for 1 s after every step, and
        # the trainer's threads on the same cores stall behind it (bench/README.md)
        argv += ["--distributed-executor-backend", "uni"]
        # a prompt prefilled in part rewinds its seeded generator, which a CPU generator
        # cannot: the engine core dies (tests/vllm/test_long_prompts.py)
        argv.append("--no-enable-chunked-prefill")
        argv += ["--block-size", str(BLOCK_TOKENS["cpu"])]  # vllm_server_args may say otherwise
    if config.vllm_server_push_in_place:
        argv += ["--worker-extension-cls", f"{SharedWeightsWorker.__module__}.SharedWeightsWorker"]
    return argv + list(config.vllm_server_args)


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


def _state_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _completion(prompt: list[int], **params: Any) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "logprobs": 0,  # the sampled token's own logprob
        "return_tokens_as_token_ids": True,
        **params,
    }


def _server_logger() -> logging.Logger:
    return logging.getLogger("vllm.server")
