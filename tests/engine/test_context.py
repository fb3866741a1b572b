"""`ExecutionContext`: captured with the engine, held for every accumulate, carried by each
decided step (engine/context.py)."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from grpod.engine import Engine, EngineConfig, decide_step
from grpod.engine.context import ExecutionContext, differences
from grpod.engine.verdict import Action, Verdict
from tests.engine.helpers import TINY


class FlushEvery:
    """A `StepPolicy` that computes every step and flushes it (the weights stay)."""

    def before(self, batch, *, per_micro_accounting):
        return batch, [], False

    def after(self, batch, report):
        return []

    def decide(self, findings):
        return Verdict(Action.FLUSH)

    def after_apply(self, model):
        return []


@pytest.fixture
def shell_threads() -> int:
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def test_the_engine_holds_its_threads_against_a_no_op_set_num_threads(
    shell_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(EngineConfig.model_validate({**TINY, "threads": 2}))
    assert engine.context.threads == 2 and torch.get_num_threads() == 2
    batch = engine.rollout()
    first = decide_step(engine, FlushEvery(), batch)
    # what a colocated vLLM CPU worker does in this process: a no-op set_num_threads, and
    # torch left at another count
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    torch._C.set_num_threads(1)
    engine.step = batch.step
    second = decide_step(engine, FlushEvery(), batch)
    assert torch.get_num_threads() == 2  # set again before the step's passes
    assert first.context == second.context == engine.context
    assert (second.report.loss, second.report.grad_norm) == (
        first.report.loss,
        first.report.grad_norm,
    )


def test_a_context_round_trips_and_names_what_differs() -> None:
    context = ExecutionContext.capture()
    assert context.threads == torch.get_num_threads()
    assert context.cpu_capability == torch.backends.cpu.get_cpu_capability()
    # the installed distribution's version (a CUDA wheel's torch.__version__ adds "+cu130")
    assert context.torch == importlib.metadata.version("torch") and context.device == "cpu"
    assert torch.__version__.startswith(context.torch.split("+")[0])
    data = {**context.to_dict(), "a_field_of_a_newer_grpod": 1}
    del data["cudnn_benchmark"]  # a field an older grpod did not record: its default
    assert ExecutionContext.from_dict(data) == context
    other = ExecutionContext.from_dict({**context.to_dict(), "torch": "9.9", "vllm": "0.1"})
    assert [(d.field, d.recorded, d.decides) for d in differences(other, context)] == [
        ("torch", "9.9", True),
        ("vllm", "0.1", False),
    ]
    replayed = context.restorable_from(
        ExecutionContext.from_dict({**context.to_dict(), "threads": 7, "cpu_capability": "X"})
    )
    assert (replayed.threads, replayed.cpu_capability) == (7, context.cpu_capability)
