"""bench/w4_vs_trl.py's set-up, without a model: both sides get the campaign's settings."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402
import w4_vs_trl  # noqa: E402
from common import engine_config, toml_trl_changed  # noqa: E402


def test_grpod_loads_the_campaign_as_grpod_run_does() -> None:
    engine = engine_config(str(w4_vs_trl.CONFIG), advantage_std="sample")
    example = ROOT / "examples" / "smollm2-arith"
    assert engine.task == str(example / "data" / "train.jsonl")
    assert engine.reward_path == str(example)
    assert engine.rewards == ["rewards:correct", "rewards:number_only"]
    assert engine.advantage_std == "sample" and engine.prompt_format == "chat"


def test_trl_gets_the_campaign_settings() -> None:
    engine = engine_config(str(w4_vs_trl.CONFIG))
    matched = w4_vs_trl.matched(engine)
    assert matched["completions_per_step"] == [32, 32]
    assert matched["lr"] == [2e-5, 2e-5]
    assert all(grpod == trl for grpod, trl in matched.values()), matched
    trl = pytest.importorskip("trl")
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert set(toml_trl_changed(engine)) <= fields


def test_arguments() -> None:
    args = w4_vs_trl.parse_args([])
    assert args.steps == 12 and args.config == str(w4_vs_trl.CONFIG) and args.idle_gap == 0.0
    assert args.max_minutes == 0.0
    with pytest.raises(SystemExit):
        w4_vs_trl.parse_args(["--steps", "2"])


def test_a_bench_records_own_threads_are_not_overwritten_by_the_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`emit` adds the host's context only where the record says nothing itself: w4_vs_trl's
    `threads` are its two sides' (before 2026-12-06 every record got the benches' constant)."""
    monkeypatch.setattr(common, "OUT_DIR", tmp_path)
    common.emit({"bench": "a", "threads": [2, 1]})
    common.emit({"bench": "b"})
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    stored = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert printed == stored
    assert stored[0]["threads"] == [2, 1] and stored[1]["threads"] == common.THREADS
    assert all(r["cpus"] and "versions" in r and "load_avg_1m" in r for r in stored)
