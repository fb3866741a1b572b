"""Shared test setup: few CPU threads (CI has 2 cores) and deterministic torch."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
