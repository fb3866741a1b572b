"""The trainer's gradient is the same bits on every run at any thread count: the states a
completion is scored from are gathered so that a shared prompt's repeats add in index order
(engine/train/forward_backward.py `_logprobs`)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch

from grpod.engine.train.forward_backward import ForwardBackward


@pytest.fixture
def shell_threads() -> int:
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def _hidden_grad(hidden: torch.Tensor, source: torch.Tensor, index: torch.Tensor) -> str:
    """sha256 of d(sum of logprobs)/d hidden through the trainer's own gather and head."""
    settings = SimpleNamespace(
        device=torch.device("cpu"), config=SimpleNamespace(lmhead_chunks=1, temperature=1.0)
    )
    head = torch.linspace(-1, 1, 50 * hidden.shape[1]).view(50, hidden.shape[1])
    targets = torch.arange(source.numel()) % 50
    hidden.grad = None
    logprobs, _ = ForwardBackward._logprobs(settings, hidden, source, head, targets, index)
    logprobs.sum().backward()
    return hashlib.sha256(hidden.grad.numpy().tobytes()).hexdigest()


def test_repeated_prompt_states_add_in_one_order_at_any_thread_count(shell_threads: int) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 256, generator=generator, requires_grad=True)
    # 8 prompts' last states, each scoring the first token of 64 completions; 1024 gathered
    # rows x 256 = 262144 values: past the size at which CPU index_put_ runs in parallel
    source = torch.randint(0, 8, (1025,), generator=generator)
    index = torch.arange(1, 1025)
    torch.set_num_threads(1)
    serial = _hidden_grad(hidden, source, index)
    seen = set()
    for threads in (2, 4) * 10:
        torch.set_num_threads(threads)
        seen.add(_hidden_grad(hidden, source, index))
    assert seen == {serial}
