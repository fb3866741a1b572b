"""A real `grpod run` through a bounded `lastrec` rollout cache: logs, metrics, bad settings."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.daemon.helpers import GRPOD, Grpod, free_port, http_get, parse_metrics, tiny_config

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

LONG_ENGINE = {  # prompts of 40..90 tokens through a 24-slot cache (3 sinks by default)
    "task": "kv-retrieval",
    "kv_retrieval_records": [7, 17],
    "seq_len": 96,
    "rollout_kv_cache": "lastrec",
    "kv_cache_length": 24,
}


def test_a_lastrec_run_logs_and_exports_its_cache(tmp_path: Path) -> None:
    port = free_port()
    config = tiny_config(tmp_path / "grpod.toml", port, LONG_ENGINE, linger_seconds=60)
    g = Grpod(["--config", str(config), "--run-dir", "run", "--max-steps", "2"], tmp_path)
    try:
        g.wait_event(lambda e: e["event"] == "stopped")
        metrics = parse_metrics(http_get(f"http://127.0.0.1:{port}/metrics")[1])
    finally:
        g.signal(signal.SIGTERM)
        rc = g.wait()
    assert rc == 0, g.stderr[-2000:]
    steps = g.steps()
    assert len(steps) == 2
    for step in steps:
        kv = step["kv_cache"]
        assert (kv["policy"], kv["length"], kv["sink_tokens"], kv["grace_period"]) == (
            "lastrec",
            24,
            3,
            0,
        )
        assert kv["prompt_tokens_evicted"] >= 16 * (40 - 24) and kv["fill"] == 1.0
        assert step["mismatch_max"] < 2e-6  # the trainer scored what the sampler saw
    assert metrics['grpod_kv_cache_slots{policy="lastrec"}'] == 24
    assert metrics['grpod_kv_cache_protected_tokens{kind="sink"}'] == 3
    assert (
        metrics["grpod_kv_cache_evicted_prompt_tokens"]
        == steps[-1]["kv_cache"]["prompt_tokens_evicted"]
    )
    assert metrics["grpod_kv_cache_fill_ratio"] == 1.0


def test_a_cache_smaller_than_its_protected_tokens_is_a_one_line_config_error(
    tmp_path: Path,
) -> None:
    config = tiny_config(
        tmp_path / "grpod.toml", free_port(), {**LONG_ENGINE, "kv_sink_tokens": 24}
    )
    for args in (["config", "check", str(config)], ["run", "--config", str(config)]):
        result = subprocess.run(
            [GRPOD, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "kv_cache_length 24 must exceed the protected tokens" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grpod.toml"]  # nothing created
