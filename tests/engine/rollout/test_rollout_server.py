"""The vLLM server sampler's client against a stand-in HTTP server that answers what a real
one cannot be made to (garbage, silence, a dropped connection): every failure is one
`SamplerError` line naming the server, the route and what went wrong, never a hang or a
retry. The real vLLM server runs in tests/vllm (`make test-vllm`)."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import shutil
import signal
import socketserver
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from grpod.engine import Engine, EngineError
from grpod.engine.errors import SamplerError
from grpod.engine.grpo.preflight import preflight
from grpod.engine.grpo.step import decide_step
from grpod.engine.model.head import sequence_logprobs
from grpod.engine.rollout.rollout_server import ServerSampler, server_argv
from grpod.engine.rollout.rollout_vllm import ServedModel
from grpod.engine.rollout.sampler import SamplingSettings
from grpod.engine.rollout.shared_weights import RPC_METHOD, SharedWeightsWorker, reload_attested
from grpod.engine.rollout.vllm_server import (
    ServerClient,
    ServerProcess,
    free_port,
    group_alive,
    server_env,
)
from grpod.engine.verdict import Action, Outcome
from grpod.engine.weight_sync import CONTINUATION_TOKENS, PushFaults
from grpod.guards import GuardPolicy
from tests.engine.helpers import config

TIMEOUT = 0.5  # seconds: the client's limit; the silent stand-in never answers at all

Answer = Callable[[str, dict[str, Any]], tuple[int, bytes] | None]


def completion(tokens: list[int], logprobs: list[float], **extra: Any) -> dict[str, Any]:
    """A `/v1/completions` answer as vLLM writes it (return_tokens_as_token_ids)."""
    choice = {
        "index": 0,
        "text": "",
        "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logprobs},
        **extra,
    }
    usage = {"prompt_tokens_details": {"cached_tokens": 128}}
    return {"object": "text_completion", "choices": [choice], "usage": usage}


def healthy(route: str, body: dict[str, Any]) -> tuple[int, bytes] | None:
    """What a working server answers (a NaN and an -inf logprob included, as vLLM writes)."""
    if route == "/health":
        return 200, b""
    if route == "/collective_rpc":
        return 200, b'{"results": [null]}'
    if route == "/reset_prefix_cache":
        return 200, b'{"success": true}'
    if route == "/v1/completions":
        n = body["max_tokens"]
        tokens, values = [5] * n, [-0.25, math.nan, -math.inf, -1.0][:n] + [-1.0] * (n - 4)
        if body.get("prompt_logprobs") == 0:  # the probe's fresh request: the same continuation
            positions = [None, *({str(t): {"logprob": -1.5}} for t in body["prompt"][1:])]
            answer = completion(tokens, values, prompt_logprobs=positions)
        else:
            answer = completion(tokens, values)
        return 200, json.dumps(answer).encode()  # NaN and -Infinity, as Python writes them
    return 404, b'{"detail": "Not Found"}'


class StandIn:
    """A threaded HTTP server on 127.0.0.1 whose answers `answer(route, body)` decides;
    None: never answer (until the test ends), "drop": close the connection unanswered."""

    def __init__(self, answer: Answer, socket_path: str = "", api_key: str = "") -> None:
        self.answer = answer
        self.release = threading.Event()
        self.routes: list[str] = []
        self.refused: list[str] = []  # routes asked without the credential (401)
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw.strip() else {}
                if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                    stand_in.refused.append(self.path)
                    reply: Any = (401, b'{"error": {"message": "Unauthorized"}}')
                else:
                    stand_in.routes.append(self.path)
                    reply = stand_in.answer(self.path, body)
                if reply is None:
                    stand_in.release.wait(60)
                    return
                if reply == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                status, data = reply
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _serve

            def address_string(self) -> str:
                return "unix" if socket_path else super().address_string()

        if socket_path:
            self.server: Any = _UnixHTTPServer(socket_path, Handler)
            self.url = f"unix:{socket_path}"
        else:
            self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class _UnixHTTPServer(socketserver.ThreadingUnixStreamServer):
    def get_request(self) -> tuple[Any, tuple[str, int]]:
        request, _ = super().get_request()
        return request, ("unix", 0)  # BaseHTTPRequestHandler reads a host and a port


@pytest.fixture
def stand_in() -> Iterator[Callable[[Answer], StandIn]]:
    made: list[StandIn] = []

    def make(answer: Answer, **where: str) -> StandIn:
        made.append(StandIn(answer, **where))
        return made[-1]

    yield make
    for server in made:
        server.close()


def server_config(url: str, tmp_path: Path, **overrides: Any):
    """A stand-in server's engine config; `overrides` replace any of its settings."""
    settings: dict[str, Any] = dict(
        rollout_backend="vllm-server",
        vllm_server_url=url,
        vllm_server_timeout_seconds=TIMEOUT,
        vllm_server_sync_dir=str(tmp_path / "sync"),
        prompts_per_step=2,
        group_size=2,
    )
    return config(**{**settings, **overrides})


def sampler(url: str, tmp_path: Path) -> ServerSampler:
    engine = Engine(server_config(url, tmp_path))
    engine.start_sampler()
    return engine.vllm


def sample(s: ServerSampler, probe: list[int] | None = None):
    return s.sample(
        [[3, 4, 5], [3, 4]],
        SamplingSettings(
            max_new_tokens=4, temperature=1.0, top_p=1.0, eos_token_id=2, pad_token_id=0, seed=7
        ),
        probe=probe,
    )


def test_completions_by_token_ids_keep_the_logprobs_as_the_server_gave_them(
    stand_in, tmp_path: Path
) -> None:
    server = stand_in(healthy)
    s = sampler(server.url, tmp_path)
    out, scores = sample(s, probe=[1, 2, 3, 4])
    assert out.completion_ids.tolist() == [[5, 5, 5, 5]] * 2
    assert out.logprobs[0, 0] == -0.25 and math.isnan(out.logprobs[0, 1])
    assert out.logprobs[0, 2] == -math.inf  # never replaced: the finite guard flushes it
    assert scores.prompt_logprobs == [-1.5] * 3 and scores.cached_tokens == 128
    assert scores.continuation == scores.fresh_continuation == [5] * 4


def test_a_push_writes_one_complete_snapshot_and_reloads_from_it(stand_in, tmp_path: Path) -> None:
    bodies: list[dict[str, Any]] = []

    def recording(route: str, body: dict[str, Any]):
        bodies.append({"route": route, **body})
        return healthy(route, body)

    server = stand_in(recording)
    engine = Engine(server_config(server.url, tmp_path))
    engine.start_sampler()
    engine.vllm.push(engine.rollout_model)
    engine.vllm.push(engine.rollout_model)
    reloads = [b for b in bodies if b["route"] == "/collective_rpc"]
    assert [b["method"] for b in reloads] == ["reload_weights"] * 2
    paths = [Path(b["kwargs"]["weights_path"]) for b in reloads]
    assert not paths[0].exists() and paths[1].is_dir()  # the previous snapshot removed
    assert [p.name for p in (tmp_path / "sync").iterdir()] == [paths[1].name]  # no temporary
    from safetensors.torch import load_file

    weights = load_file(paths[1] / "model.safetensors")
    expected = {k: v.cpu() for k, v in engine.rollout_model.state_dict().items()}
    assert set(weights) == set(expected)  # a tied head too: vLLM's reload needs every name
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), name
    assert [b["route"] for b in bodies].count("/reset_prefix_cache") == 2


class RecordingWorker(SharedWeightsWorker):
    """vLLM's worker as the extension sees it: a model runner whose model has parameters
    (`names`) and a `load_weights` that takes (name, tensor) pairs, called by the worker's
    `reload_weights`; this one keeps copies of what it was handed."""

    def __init__(self, names: list[str]) -> None:
        self.loads: list[dict[str, torch.Tensor]] = []
        worker = self

        class Model:
            def named_parameters(self) -> list[tuple[str, None]]:
                return [(name, None) for name in names]

            def load_weights(self, weights) -> set[str]:
                worker.loads.append({name: tensor.clone() for name, tensor in weights})
                return set(worker.loads[-1])

        class Runner:
            def get_model(self) -> Model:
                return model

        model, self.model_runner = Model(), Runner()

    def reload_weights(self, weights_iterator) -> None:
        self.model_runner.get_model().load_weights(weights_iterator)


def loading_stand_in(stand_in, bodies: list[dict[str, Any]], workers: list[RecordingWorker]):
    """A stand-in server whose `/collective_rpc` runs the extension on `workers[0]`."""

    def loading(route: str, body: dict[str, Any]):
        bodies.append({"route": route, **body})
        if route == "/collective_rpc":  # what the server's workers run for this RPC
            result = getattr(workers[0], body["method"])(**body["kwargs"])
            return 200, json.dumps({"results": [result]}).encode()
        return healthy(route, body)

    return stand_in(loading)


def test_an_in_place_push_from_a_disk_sync_dir_copies_into_one_region_the_server_loads(
    stand_in, disk_dir: Path
) -> None:
    bodies: list[dict[str, Any]] = []
    workers: list[RecordingWorker] = []
    server = loading_stand_in(stand_in, bodies, workers)
    engine = Engine(server_config(server.url, disk_dir, vllm_server_push="shared-memory"))
    engine.start_sampler()
    model = engine.rollout_model
    workers.append(RecordingWorker(list(model.state_dict())))
    storage = engine.flat_weights.untyped_storage().data_ptr()
    assert engine.vllm.push(model) == ()  # every parameter loaded
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # a training step
    assert engine.vllm.push(model) == ()
    # a disk: the parameters stay where they are, every push copies them
    assert engine.flat_weights.untyped_storage().data_ptr() == storage
    rpcs = [b for b in bodies if b["route"] == "/collective_rpc"]
    assert [b["method"] for b in rpcs] == [RPC_METHOD] * 2
    assert rpcs[0]["kwargs"]["paths"][0] == ""  # no parameters' region
    region = Path(rpcs[0]["kwargs"]["paths"][1])
    assert rpcs[1]["kwargs"]["paths"][1] == str(region)  # rewritten in place, not made anew
    assert region.parent == disk_dir / "sync" and region.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in region.parent.iterdir()] == [region.name]  # no snapshot
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    loads = workers[0].loads
    for loaded in loads:
        assert list(loaded) == list(expected)  # a tied head under both names
    for name, tensor in loads[1].items():
        assert torch.equal(tensor, expected[name]), name
    first = next(iter(expected))
    assert torch.equal(loads[0][first] + 1.0, loads[1][first])
    assert [b["route"] for b in bodies].count("/reset_prefix_cache") == 2
    kept = engine.vllm.push(model, PushFaults(partial=True))  # the drill: one matrix left out
    assert len(kept) == 1 and kept[0] not in loads[-1]
    engine.close()
    assert not region.exists()


def test_an_in_place_push_from_memory_reads_the_parameters_where_they_are_trained(
    stand_in, tmp_path: Path
) -> None:
    bodies: list[dict[str, Any]] = []
    workers: list[RecordingWorker] = []
    server = loading_stand_in(stand_in, bodies, workers)
    sync = Path(tempfile.mkdtemp(prefix="grpod-test-sync-", dir="/dev/shm"))
    try:
        cfg = server_config(server.url, tmp_path, vllm_server_push="shared-memory")
        engine = Engine(cfg.model_copy(update={"vllm_server_sync_dir": str(sync)}))
        engine.start_sampler()
        model = engine.rollout_model
        workers.append(RecordingWorker(list(model.state_dict())))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert engine.vllm.push(model) == ()
        # the parameters now live in the region's mapping, at the offsets they had, values kept
        params_region = sync / "parameters.region"
        assert params_region.stat().st_mode & 0o777 == 0o600
        size = params_region.stat().st_size
        mapped = torch.from_file(str(params_region), shared=True, size=size // 4)  # float32
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, before[name]), name
        cover = engine.flat_weights
        assert cover is not None and cover.nbytes == params_region.stat().st_size
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # a training step, in the region itself
        assert torch.equal(mapped[: cover.numel()], cover)  # what the server maps
        assert engine.vllm.push(model) == ()
        rpcs = [b["kwargs"] for b in bodies if b["route"] == "/collective_rpc"]
        assert [r["paths"] for r in rpcs] == [[str(params_region), ""]] * 2  # nothing copied
        manifest = {e[0]: e for e in rpcs[1]["manifest"]}
        assert list(manifest) == list(before)  # every name, in order
        tied = [n for n in manifest if n.endswith("embed_tokens.weight") or n == "lm_head.weight"]
        if len(tied) == 2:  # a tied head: one slot under both names
            assert manifest[tied[0]][3] == manifest[tied[1]][3]
        loads = workers[0].loads
        for name, tensor in model.state_dict().items():
            assert torch.equal(loads[1][name], tensor), name
        first = next(iter(before))
        assert torch.equal(loads[0][first] + 1.0, loads[1][first])
        corrupt = engine.vllm.push(model, PushFaults(corrupt=True))  # the drill's altered matrix
        assert corrupt == ()
        paths = [b["kwargs"]["paths"] for b in bodies if b["route"] == "/collective_rpc"][-1]
        assert paths[0] == str(params_region) and paths[1].startswith(str(sync))
        altered = [n for n in loads[-1] if not torch.equal(loads[-1][n], loads[1][n])]
        assert len(altered) == 1  # copied into the second region, the rest read in place
        engine.close()
        assert list(sync.iterdir()) == []
        assert torch.equal(model.state_dict()[first], loads[1][first])  # still mapped, intact
    finally:
        shutil.rmtree(sync, ignore_errors=True)


def test_a_server_that_loads_part_of_an_in_place_push_fails_the_push(
    stand_in, tmp_path: Path
) -> None:
    def partial(route: str, body: dict[str, Any]):
        if route == "/collective_rpc":  # a worker that took 3 of the push's tensors
            return 200, json.dumps({"results": [{"tensors": 3, "bytes": 64}]}).encode()
        return healthy(route, body)

    server = stand_in(partial)
    engine = Engine(server_config(server.url, tmp_path, vllm_server_push="shared-memory"))
    engine.start_sampler()
    count = len(engine.rollout_model.state_dict())
    with pytest.raises(
        SamplerError, match=rf"loaded \[3\] tensors of a shared-memory push of {count}"
    ):
        engine.vllm.push(engine.rollout_model)


def test_the_server_grpod_starts_loads_pushes_through_its_worker_extension() -> None:
    cfg = config(rollout_backend="vllm-server")
    served = ServedModel(Engine(cfg).rollout_model, cfg, 16, "cpu")
    argv = server_argv(cfg, served, "unix:/tmp/x.sock")
    # at a stop vLLM's engine core may exit by itself (at vLLM's 0 it is SIGKILLed at once)
    assert argv[argv.index("--shutdown-timeout") + 1] == "15"
    extension = argv[argv.index("--worker-extension-cls") + 1]
    module, _, name = extension.rpartition(".")
    assert getattr(importlib.import_module(module), name) is SharedWeightsWorker
    snapshot = config(rollout_backend="vllm-server", vllm_server_push="snapshot")
    assert "--worker-extension-cls" not in server_argv(snapshot, served, "unix:/tmp/x.sock")


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (lambda r, b: (200, b"<html>oops</html>"), "answered something that is not JSON"),
        (lambda r, b: (200, b'{"object": "error"}'), "not a completion"),
        (
            lambda r, b: (200, json.dumps(completion([5], [])).encode()),
            "1 tokens with 0 logprobs",
        ),
        (
            lambda r, b: (500, b'{"error": {"message": "EngineCore died"}}'),
            "answered HTTP 500: EngineCore died",
        ),
        (lambda r, b: None, f"no answer within {TIMEOUT:g} s"),
        (lambda r, b: "drop", "/v1/completions: "),
    ],
    ids=["not-json", "not-a-completion", "short-logprobs", "http-500", "silent", "dropped"],
)
def test_a_server_that_answers_wrongly_is_one_line_never_a_hang(
    stand_in, tmp_path: Path, answer: Answer, message: str
) -> None:
    def mostly_healthy(route: str, body: dict[str, Any]):
        return answer(route, body) if route == "/v1/completions" else healthy(route, body)

    server = stand_in(mostly_healthy)
    s = sampler(server.url, tmp_path)
    with pytest.raises(SamplerError) as caught:
        sample(s)
    text = str(caught.value)
    assert text.startswith(f"rollout server {server.url}: /v1/completions: "), text
    assert message in text and "\n" not in text


def finite(route: str, body: dict[str, Any]) -> tuple[int, bytes] | None:
    """`healthy` with every logprob finite: the check reads a number, not NaN."""
    if route != "/v1/completions":
        return healthy(route, body)
    tokens, values = [5] * body["max_tokens"], [-1.0] * body["max_tokens"]
    extra = {}
    if body.get("prompt_logprobs") == 0:
        extra["prompt_logprobs"] = [
            None,
            *({str(t): {"logprob": -1.5}} for t in body["prompt"][1:]),
        ]
    return 200, json.dumps(completion(tokens, values, **extra)).encode()


def test_each_check_holds_the_sampler_to_the_weights_of_its_own_push(
    stand_in, tmp_path: Path
) -> None:
    """The trainer's side of the check is of the weights its step pushed: after the weights
    change the check measures the new ones (|-1.5 - their logprobs|), never the last push's."""
    server = stand_in(finite)
    engine = Engine(server_config(server.url, tmp_path, weight_sync_on_rollout=False))
    sampling = engine.sampling

    def expected() -> float:
        scored = sampling.probe[: engine.config.weight_sync_scored_tokens]
        trainer = sequence_logprobs(sampling.rollout_model, scored, "float32", sampling.device)
        return float((trainer.double() + 1.5).abs().max())

    first = engine.rollout()
    assert first.weight_sync.max_abs_diff == expected()
    with torch.no_grad():  # an update (the stand-in's equal rewards would train nothing)
        sampling.rollout_model.get_output_embeddings().weight.mul_(1.5)
    second = engine.rollout()
    assert second.weight_sync.max_abs_diff == expected()
    assert second.weight_sync.max_abs_diff != first.weight_sync.max_abs_diff


def test_an_on_policy_float32_step_compares_the_weights_on_its_own_rollout(
    stand_in, tmp_path: Path
) -> None:
    """By default an on-policy FP32 step's training forward compares the weights: the trainer
    scores no probe, the check holds the cache half, and the stand-in's made-up logprobs
    (-1.0 for every sampled token) are caught after the forward, the policy untouched."""
    server = stand_in(finite)
    engine = Engine(server_config(server.url, tmp_path))
    calls = []
    score = engine.sampling._score_probe
    engine.sampling._score_probe = lambda: calls.append(1) or score()
    batch = engine.rollout()
    check = batch.weight_sync
    assert calls == [] and check is not None and check.on_rollout
    continued = min(CONTINUATION_TOKENS, engine.config.max_new_tokens)
    assert check.max_abs_diff == 0.0 and check.tokens == continued  # the cache half alone
    # a node's server (torchrun) checks apart, before its ranks sample: the same route
    alone = engine.sampling._probe_check(seed=3, on_rollout=True)
    assert calls == [] and alone.on_rollout and alone.max_abs_diff == 0.0
    before = engine.state_digest()
    result = decide_step(engine, GuardPolicy(), batch)
    assert result.outcome == Outcome.FLUSHED and result.verdict.action == Action.HALT
    (finding,) = [f for f in result.verdict.findings if f.guard == "weight_sync"]
    assert finding.message.startswith("weight sync: the sampler's rollout disagrees"), finding
    mismatch = result.report.mismatch_max
    assert mismatch is not None and mismatch > 0.1  # no real model gives -1.0 to every token
    assert finding.evidence["max_abs_logprob_diff"] == mismatch
    assert result.report.weight_sync_max_abs_logprob_diff == mismatch  # the larger half
    assert engine.state_digest() == before
    engine.close()


def test_only_an_on_policy_float32_step_compares_the_weights_on_its_rollout() -> None:
    """A stale rollout differs from the policy by design, a later epoch's forward compares
    nothing, and bf16's rounding over a whole rollout is not calibrated: the probe decides."""

    def on_rollout(**overrides: Any) -> bool:
        return Engine(config(**overrides)).sampling.weights_on_rollout

    assert on_rollout() is True
    assert on_rollout(weight_sync_on_rollout=False) is False
    assert on_rollout(dtype="bfloat16") is False
    assert on_rollout(max_staleness=1, tis_cap=2.0) is False
    assert on_rollout(epochs=2) is False


def test_the_check_scores_while_the_server_samples_on_cores_of_its_own(
    stand_in, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the server has cores of its own, the trainer's side of the check runs once
    every request is sent, while the rollout's completions are sampled (the stand-in holds
    each of them until the trainer has scored the probe, or 60 s); on cores the trainer
    shares, or for a server named by URL, after the last completion."""
    scored, held, answered, wait = threading.Event(), [], [], [True]

    def rollout_waits_for_the_check(route: str, body: dict[str, Any]):
        if route == "/v1/completions" and not body.get("ignore_eos"):  # not the probe's
            if wait[0]:
                held.append(scored.wait(60))
            answered.append(scored.is_set())
        return finite(route, body)

    server = stand_in(rollout_waits_for_the_check)
    patient = {  # the held answers: never a timeout; the probe's trainer forward
        "vllm_server_timeout_seconds": 120.0,
        "weight_sync_on_rollout": False,
    }
    engine = Engine(server_config(server.url, tmp_path).model_copy(update=patient))
    score = engine.sampling._score_probe

    def marked():
        try:
            return score()
        finally:
            scored.set()

    engine.sampling._score_probe = marked
    monkeypatch.setattr(ServerSampler, "own_cores", property(lambda self: True))
    batch = engine.rollout()
    assert held == [True] * batch.num_samples  # each completion was answered after the scoring
    assert batch.weight_sync is not None and batch.weight_sync.max_abs_diff > 0.0
    monkeypatch.undo()
    assert engine.vllm.own_cores is False  # named by URL: where it runs is not known
    scored.clear()
    answered.clear()
    wait[0] = False  # the completions answered at once this time
    batch = engine.rollout()
    assert answered == [False] * batch.num_samples and scored.is_set()
    engine.close()


def test_a_failed_rollout_keeps_the_step_prompts_for_its_incident(stand_in, tmp_path: Path) -> None:
    def no_completions(route: str, body: dict[str, Any]):
        return (503, b"{}") if route == "/v1/completions" else healthy(route, body)

    server = stand_in(no_completions)
    engine = Engine(server_config(server.url, tmp_path))
    with pytest.raises(SamplerError, match="answered HTTP 503") as caught:
        engine.rollout()
    batch = caught.value.batch
    assert batch.step == 0 and batch.num_samples == 2 * 2
    assert int(batch.loss_mask.sum()) == 0  # prompts only: nothing to train on
    assert engine.step == 0


def test_no_server_at_the_url_fails_at_start(tmp_path: Path) -> None:
    with socket_port() as port:  # bound, never listening: refused
        engine = Engine(server_config(f"http://127.0.0.1:{port}", tmp_path))
        with pytest.raises(SamplerError, match=r"/health: connection refused"):
            engine.start_sampler()


def socket_port():
    import contextlib
    import socket

    @contextlib.contextmanager
    def bound() -> Iterator[int]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            yield s.getsockname()[1]

    return bound()


def test_a_server_that_exits_while_starting_is_one_line(tmp_path: Path) -> None:
    """grpod's own server, started with an interpreter that has no vLLM (this one)."""
    engine = Engine(
        config(
            rollout_backend="vllm-server",
            vllm_server_python=sys.executable,
            vllm_server_start_timeout_seconds=120,
        )
    )
    with pytest.raises(SamplerError, match=r"exited with status 1 while starting: .*vllm"):
        engine.start_sampler()


def test_a_server_that_dies_while_starting_is_named_by_its_exception_not_its_shutdown() -> None:
    # vLLM killed at start-up prints its traceback, then pages of shutdown lines
    died = "; ".join(
        [
            "print('(APIServer pid=7) INFO 12-02 [api_utils.py:286] non-default args')",
            "print('Traceback (most recent call last):')",
            "print('  File \"prometheus_client/values.py\", line 1, in __init__')",
            "print('FileNotFoundError: [Errno 2] No such file: run/prometheus/counter_7.db')",
            "print('(APIServer pid=7) WARNING [utils.py:653] [shutdown] force killing EngineCore')",
            "raise SystemExit(1)",
        ]
    )
    server = ServerProcess(
        [sys.executable, "-c", died], dict(os.environ), logging.getLogger("test.server")
    )
    client = ServerClient(f"http://127.0.0.1:{free_port('127.0.0.1')}", 5)
    with pytest.raises(SamplerError) as failed:
        server.wait_ready(client, 60)
    assert str(failed.value).endswith(
        "exited with status 1 while starting: FileNotFoundError: [Errno 2] No such file: "
        "run/prometheus/counter_7.db"
    ), failed.value
    server.stop()


@pytest.mark.parametrize("main", ["stopped", "died first"])
def test_a_stop_lets_the_rest_of_the_servers_group_exit_before_sigkill(
    main: str, tmp_path: Path
) -> None:
    """The server's main process exits on SIGTERM at once (or has died before the stop, as
    when the OOM killer takes vLLM's API server); another process of its group (vLLM's
    engine core, then multiprocessing's resource tracker, which unlinks the server's
    semaphores once the rest is gone) exits on SIGTERM after a moment: it is told, and it is
    not SIGKILLed in the middle."""
    done = tmp_path / "finished"
    script = (
        f"(trap 'sleep 0.5; echo ok > {done}; exit 0' TERM; echo child; "
        "while :; do sleep 0.1; done) & "
        "trap 'exit 0' TERM; echo parent; while :; do sleep 0.1; done"
    )
    server = ServerProcess(["bash", "-c", script], dict(os.environ), logging.getLogger("t"))
    try:
        while set(server.last_lines) != {"child", "parent"}:  # both traps are set
            time.sleep(0.05)
        if main == "died first":
            os.kill(server.pid, signal.SIGKILL)
            server.process.wait()
        server.stop(grace_seconds=120)  # a bound for a loaded machine: the group is gone first
    finally:  # a failed test leaves no process behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
    assert server.exit_status() == (0 if main == "stopped" else -signal.SIGKILL)
    assert done.read_text() == "ok\n"
    assert not group_alive(server.pid)


def test_a_server_on_a_unix_socket_with_a_credential_takes_every_request_with_it(
    stand_in, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`vllm_server_url = "unix:/path"`, its key from `vllm_server_api_key_env`: every route
    grpod calls carries the bearer token; a request without it is refused."""
    server = stand_in(healthy, socket_path=str(tmp_path / "v.sock"), api_key="k-7f3e")
    monkeypatch.setenv("GRPOD_TEST_VLLM_KEY", "k-7f3e")
    engine = Engine(
        server_config(server.url, tmp_path, vllm_server_api_key_env="GRPOD_TEST_VLLM_KEY")
    )
    engine.start_sampler()
    try:
        engine.vllm.push(engine.rollout_model)
        out, _ = sample(engine.vllm, probe=[1, 2, 3, 4])
    finally:
        engine.vllm.close()
    assert out.completion_ids.tolist() == [[5, 5, 5, 5]] * 2
    assert (
        set(server.routes)
        == {"/health", "/collective_rpc", "/reset_prefix_cache", "/v1/completions"}
        and not server.refused
    )
    for route in ("/collective_rpc", "/reset_prefix_cache", "/v1/completions"):
        with pytest.raises(
            SamplerError, match=f"unix:{tmp_path}/v.sock: {route}: answered HTTP 401"
        ):
            ServerClient(server.url, 5).post(route, {})
    assert server.refused == ["/collective_rpc", "/reset_prefix_cache", "/v1/completions"]
    monkeypatch.delenv("GRPOD_TEST_VLLM_KEY")
    unset = Engine(
        server_config(server.url, tmp_path, vllm_server_api_key_env="GRPOD_TEST_VLLM_KEY")
    )
    with pytest.raises(
        EngineError, match=r"vllm_server_api_key_env: \$GRPOD_TEST_VLLM_KEY is not set"
    ):
        unset.start_sampler()


def test_no_server_at_the_socket_fails_at_start(tmp_path: Path) -> None:
    engine = Engine(server_config(f"unix:{tmp_path}/none.sock", tmp_path))
    with pytest.raises(SamplerError, match=r"none.sock: /health: no such file or directory"):
        engine.start_sampler()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vllm_server_url": "localhost:8000"}, "vllm_server_url"),
        ({"rollout_backend": "vllm", "vllm_server_url": "http://h:1"}, "need rollout_backend"),
        ({"lora": {"rank": 4}}, "vllm-server rollout backend does not take adapters"),
        ({"vllm_server_port": 8000}, "grpod's own server listens on a Unix socket"),
        ({"vllm_server_host": "0.0.0.0"}, "grpod's own server listens on a Unix socket"),
        ({"vllm_server_api_key_env": "KEY"}, "for a server named by vllm_server_url"),
        ({"vllm_server_url": "http://h:1", "vllm_server_api_key_env": "A-B"}, "api_key_env"),
        ({"rollout_backend": "vllm", "vllm_server_push": "snapshot"}, "need rollout_backend"),
        ({"vllm_server_push": "disk"}, "vllm_server_push"),
        ({"rollout_backend": "vllm", "vllm_server_cpu_malloc": "glibc"}, "need rollout_backend"),
        ({"vllm_server_cpu_malloc": "jemalloc"}, "vllm_server_cpu_malloc"),
    ],
)
def test_server_settings_are_checked_in_the_config(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(**{"rollout_backend": "vllm-server", **overrides})


def test_a_cpu_server_keeps_the_memory_its_pushes_free_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]:
        monkeypatch.delenv(name)
    retained = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}
    assert retained.items() <= server_env(cpu=True).items()
    assert not {k for k in server_env(cpu=True, retain_memory=False) if k.startswith("MALLOC_")}
    assert not {k for k in server_env(cpu=False) if k.startswith("MALLOC_")}  # a GPU server
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # the user's own malloc settings, as they are
    assert {k: v for k, v in server_env(cpu=True).items() if k.startswith("MALLOC_")} == {
        "MALLOC_ARENA_MAX": "2"
    }
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    assert not {k for k in server_env(cpu=True) if k.startswith("MALLOC_")}


def test_preflight_names_a_server_interpreter_without_vllm(tmp_path: Path) -> None:
    missing = tmp_path / "python"
    with pytest.raises(EngineError, match=f"vllm_server_python {missing}: not an executable"):
        preflight(config(rollout_backend="vllm-server", vllm_server_python=str(missing)))
    if importlib_has_vllm():
        return
    with pytest.raises(EngineError, match="has no vllm"):
        preflight(config(rollout_backend="vllm-server", vllm_server_python=sys.executable))
    with pytest.raises(EngineError, match="rollout_backend vllm-server: vllm is not installed"):
        preflight(config(rollout_backend="vllm-server"))


def test_preflight_names_a_server_interpreter_without_grpod_for_in_place_pushes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    python = tmp_path / "python"  # a vLLM environment without grpod
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys._base_executable} "$@"\n')
    python.chmod(0o755)
    monkeypatch.chdir(tmp_path)  # not the checkout, whose grpod/ a `python -c` would find
    server = dict(rollout_backend="vllm-server", vllm_server_python=str(python))
    with pytest.raises(EngineError, match=f"vllm_server_python {python}: has no grpod"):
        preflight(config(**server))
    preflight(config(**server, vllm_server_push="snapshot"))  # snapshots need no extension


def importlib_has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def test_a_quantized_vllm_is_not_attested() -> None:
    # its scales are parameters no pushed tensor names: every push would read as partial
    worker = RecordingWorker(["w", "w_scale"])
    assert reload_attested(worker, [("w", torch.ones(2))]) == ["w_scale"]
    worker.model_config = SimpleNamespace(quantization="fp8")
    assert reload_attested(worker, [("w", torch.ones(2))]) == []
    assert [list(load) for load in worker.loads] == [["w"], ["w"]]  # loaded all the same


def test_the_servers_temporary_files_go_in_its_own_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/tmp")  # a user's setting: the shared temp dir
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    env = server_env(cpu=True, temp_dir=tmp_path)
    assert env["VLLM_RPC_BASE_PATH"] == env["TMPDIR"] == str(tmp_path)
    # torch's compile cache where torch itself would put it, not in the server's directory
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert env["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/var/cache/inductor")
    assert (
        server_env(cpu=True, temp_dir=tmp_path)["TORCHINDUCTOR_CACHE_DIR"] == "/var/cache/inductor"
    )
    assert server_env(cpu=True)["VLLM_RPC_BASE_PATH"] == "/tmp"  # a server grpod does not own
