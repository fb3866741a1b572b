"""Fixtures shared by the engine tests: the stand-in vLLM server (test_rollout_server.py)."""

from tests.engine.rollout.test_rollout_server import stand_in  # noqa: F401
