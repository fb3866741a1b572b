"""A LoRA campaign as the daemon runs it: guards, recorder and replay unchanged (bit-exact on
CPU), checkpoints of the adapters alone, export merged or as a PEFT adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.daemon.helpers import run_to_end, tiny_config

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

pytest.importorskip("peft")  # the `lora` extra (in `dev`)


def test_lora_run_replays_bit_exactly_and_exports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    from grpod.daemon.cli import main

    config = tiny_config(tmp_path / "grpod.toml", 0, {"lr": 1e-2}, max_steps=4)
    extra = "\n[engine.faults]\nnan_loss_steps = [2]\n\n[engine.lora]\nrank = 4\nalpha = 8.0\n"
    # no pruning while running: both earlier checkpoints are incident-pinned, which would
    # start retention at step 4 and drop step 3's batch
    extra += "\n[forensics]\nkeep_checkpoints = 0\n"
    config.write_text(config.read_text() + extra)
    run = tmp_path / "run"
    g = run_to_end(["--config", str(config), "--run-dir", str(run)], tmp_path)
    outcomes = [e["outcome"] for e in g.steps()]
    assert outcomes == ["applied", "applied", "flushed", "applied"]  # the finite guard
    saved = load_file(str(run / "checkpoints/step-00000004/model.safetensors"))
    assert saved and all(".lora_A." in n or ".lora_B." in n for n in saved)
    for args in (["1"], ["--step", "3"]):  # the flushed step's incident, and a step after it
        assert main(["replay", "--run-dir", str(run), "--json", *args]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["reproduced"] is True, result
    assert main(["export", "--run-dir", str(run), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora_" in name for name in merged.state_dict())
    assert main(["export", "--run-dir", str(run), "--adapter", str(tmp_path / "adapter")]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
