"""vLLM settings that cannot work are refused before anything is written (exit 2, one line):
a KV cache too small for one sequence, a `--max-model-len` shorter than grpod's requests, a
head dim vLLM's CPU attention lacks (preflight, engine/rollout/vllm_limits.py), and server arguments
the vLLM server itself refuses (its argparse error, mapped to exit 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from grpod.engine import Engine, EngineConfig, EngineError
from grpod.engine.rollout.rollout_vllm import VLLMSampler
from grpod.engine.rollout.vllm_limits import served_lengths
from tests.daemon.helpers import cli, run_to_end, write_config
from tests.hfdir import build_hf_dir

pytestmark = pytest.mark.slow

TINY: dict[str, Any] = {"task": "copy", "prompts_per_step": 2, "group_size": 2, "threads": 1}
# the tiny model in float32: 4 layers x 2 KV heads x head dim 32 x (K, V) x 4 bytes a token;
# max_model_len 64 (seq_len; the weight-sync probe, one 32-token block and a token, + 8 is
# 41) is 2 blocks of 32, one more held back
TINY_KV_BYTES = 4 * 2 * 32 * 2 * 4 * 32 * (2 + 1)


def _config(work: Path, **engine: Any) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    return write_config(
        work / "grpod.toml",
        {
            "engine": {**TINY, "rollout_backend": "vllm", **engine},
            "daemon": {"metrics": False, "log_format": "json", "progress": "off"},
        },
    )


def _not_cpp(stderr: str) -> list[str]:
    """stderr's lines but vLLM's CPU build's C++ NUMA note (written by C++ code straight to
    the descriptor, past Python's logging; its Python warnings go to the JSON log)."""
    return [line for line in stderr.splitlines() if "utils.cpp" not in line]


def _refused(work: Path, needle: str) -> None:
    """`grpod run` refuses in one line, exit 2, and leaves nothing but its config."""
    done = cli("run", "--config", "grpod.toml", "--run-dir", "run", cwd=work)
    assert done.returncode == 2, done.stderr
    (line,) = _not_cpp(done.stderr)
    assert line.startswith("grpod run: error: ") and needle in line, line
    assert sorted(p.name for p in work.iterdir()) == ["grpod.toml"]


def test_a_kv_cache_too_small_for_one_sequence_is_refused_before_the_run_dir(
    tmp_path: Path,
) -> None:
    _config(tmp_path, vllm_kv_cache_bytes=4096)
    _refused(
        tmp_path,
        f"vllm_kv_cache_bytes 4096: one sequence of max_model_len 64 tokens (seq_len 64, the "
        f"weight-sync probe 33 + 8) needs {TINY_KV_BYTES} bytes of vLLM's KV cache",
    )


def test_the_refused_bound_is_vllms_own(tmp_path: Path) -> None:
    """One byte below the bound vLLM itself cannot start; at the bound a run trains."""
    config = EngineConfig(**TINY, rollout_backend="vllm", vllm_kv_cache_bytes=TINY_KV_BYTES - 1)
    engine = Engine(config)  # vLLM starts on the first rollout: here, without preflight
    with pytest.raises(EngineError, match="cannot start vLLM"):
        VLLMSampler(engine.rollout_model, config, config.weight_sync_probe_tokens)
    assert served_lengths(config, None, "cpu") == (33, 64)
    assert served_lengths(config, None, "cuda") == (17, 64)  # a 16-token block and a token

    below = tmp_path / "below"
    _config(below, vllm_kv_cache_bytes=TINY_KV_BYTES - 1)
    done = cli("config", "check", "grpod.toml", cwd=below)
    assert done.returncode == 2 and f"give it at least {TINY_KV_BYTES}" in done.stderr
    at = tmp_path / "at"
    _config(at, vllm_kv_cache_bytes=TINY_KV_BYTES)
    ran = run_to_end(["--config", "grpod.toml", "--run-dir", "run", "--max-steps", "1"], at)
    # grpod's lines only: no progress bars (the tiny model's export, vLLM's load), vLLM's
    # and torch's warnings at import in the JSON log
    assert [line.split(":")[0] for line in _not_cpp(ran.stderr)] == ["store", "replay a step"]


def test_max_model_len_and_head_dim_are_refused_before_the_run_dir(tmp_path: Path) -> None:
    short = tmp_path / "short"
    _config(short, rollout_backend="vllm-server", vllm_server_args=["--max-model-len", "32"])
    _refused(
        short,
        "vllm_server_args: --max-model-len 32 is shorter than grpod's longest request of 64 "
        "tokens (seq_len 64, the weight-sync probe 33 + 8)",
    )
    model = build_hf_dir(tmp_path / "model", hidden_size=64)  # 4 heads of 16
    heads = tmp_path / "heads"
    _config(heads, model=str(model), task="copy")
    _refused(heads, "head dim 16: vLLM's CPU attention takes head sizes 32, 64")


def test_server_arguments_the_server_refuses_are_a_config_error(tmp_path: Path) -> None:
    _config(tmp_path, rollout_backend="vllm-server", vllm_server_args=["--no-such-flag"])
    _refused(
        tmp_path,
        "vllm_server_args: the vLLM server refused its arguments: unrecognized arguments: "
        "--no-such-flag",
    )


def test_a_cache_vllm_cannot_allocate_is_refused_before_the_run_dir(tmp_path: Path) -> None:
    """What only vLLM knows (here: more cache than the machine's memory) is found as it
    starts, before the run dir: colocated vLLM starts with the engine, not at step 0."""
    _config(tmp_path, vllm_kv_cache_bytes=1 << 50)
    _refused(tmp_path, "rollout_backend vllm: cannot start vLLM: ValueError: Available memory")
