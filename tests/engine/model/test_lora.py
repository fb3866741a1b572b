"""LoRA with PEFT: only the FP32 adapters train and are checkpointed, the base stays
bit-identical, the KL reference is the base with adapters disabled, and export merges them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft")  # the `lora` extra (in `dev`)

from grpod.engine import Engine, EngineError
from grpod.engine.grpo.preflight import preflight
from grpod.engine.state.export import export_pretrained
from tests.engine.helpers import config

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _steps(engine: Engine, n: int) -> list:
    reports = []
    for _ in range(n):
        reports.append(engine.accumulate(engine.rollout()))
        engine.apply()
    return reports


def test_only_the_adapters_train_and_checkpoint(tmp_path: Path) -> None:
    engine = Engine(config(lora=LORA, lr=1e-2))
    trained = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert len(trained) == 2 * 3 * 4  # A and B for 3 modules in each of the 4 layers
    assert all(p.dtype == torch.float32 for p in engine.params)
    assert sum(len(g["params"]) for g in engine.optimizer.param_groups) == len(trained)
    base = {n: t.clone() for n, t in engine.model.state_dict().items() if "lora_" not in n}
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters() if n in trained}
    _steps(engine, 3)
    after = engine.model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in base.items())  # the base never moves
    assert any(not torch.equal(after[n], before[n]) for n in trained)
    path = engine.save_checkpoint(tmp_path / "ckpt")
    assert set(load_file(str(path / "model.safetensors"))) == trained  # adapters only
    resumed = Engine(config(lora=LORA, lr=1e-2))
    resumed.load_checkpoint(path)
    assert resumed.state_digest() == engine.state_digest()
    a, b = _steps(engine, 1)[0], _steps(resumed, 1)[0]
    assert (a.loss, a.grad_norm, a.valid_tokens) == (b.loss, b.grad_norm, b.valid_tokens)


def test_kl_reference_is_the_base_with_adapters_disabled() -> None:
    engine = Engine(config(lora=LORA, lr=1e-2, kl_beta=0.1))
    assert engine.reference is None  # no second copy of the model
    first, *_, last = _steps(engine, 4)
    assert first.kl == 0.0  # lora_B starts at zero: the policy is the base
    assert last.kl > 0.0
    adapters_on = engine.model.model.layers[0].self_attn.q_proj
    assert not adapters_on.disable_adapters  # re-enabled after the reference pass


def test_export_merges_or_writes_the_adapter(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = config(lora=LORA, lr=1e-2)
    engine = Engine(cfg)
    _steps(engine, 2)
    checkpoint = engine.save_checkpoint(tmp_path / "ckpt")
    out = export_pretrained(cfg, checkpoint, tmp_path / "m")
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora_" in n for n in merged.state_dict())
    adapter_dir = export_pretrained(cfg, checkpoint, tmp_path / "a", adapter=True)
    ids = torch.tensor([[1, 4, 13, 5, 14]])
    base = Engine(config()).model
    on = ids.to(engine.device)  # the engine's models on its device, the exported one on the CPU
    with torch.no_grad():
        ours, untrained = engine.model(on).logits.cpu(), base(on).logits.cpu()
        theirs = merged(ids).logits
        loaded = PeftModel.from_pretrained(base, adapter_dir)(on).logits.cpu()  # into base
    assert torch.allclose(ours, theirs, atol=1e-5) and not torch.equal(ours, untrained)
    assert torch.allclose(ours, loaded, atol=1e-6)
    assert (adapter_dir / "adapter_config.json").is_file()
    with pytest.raises(EngineError, match="the run has no LoRA adapters"):
        export_pretrained(config(), checkpoint, tmp_path / "x", adapter=True)


def test_bad_target_modules_are_one_line() -> None:
    with pytest.raises(EngineError, match=r"engine.lora: .*nope"):
        Engine(config(lora={**LORA, "target_modules": ["nope"]}))


@pytest.mark.parametrize(
    ("targets", "needle"),
    [
        (["nope"], "Target modules {'nope'} not found in the base model"),
        (["mlp"], "Target module Qwen2MLP( (gate_proj): Linear("),
        (["lm_head"], "lm_head shares its weight with the input embeddings"),
    ],
)
def test_preflight_refuses_the_targets_the_engine_refuses(targets: list[str], needle: str) -> None:
    """`config check` and `run` both preflight: the same one-line error, before any weights."""
    bad = config(lora={**LORA, "target_modules": targets})
    with pytest.raises(EngineError) as checked:
        preflight(bad)
    with pytest.raises(EngineError) as built:
        Engine(bad)
    assert str(checked.value) == str(built.value)
    assert needle in str(checked.value) and "\n" not in str(checked.value)
    preflight(config(lora=LORA))  # the good targets pass


def test_a_flushed_step_leaves_the_adapters_and_adam_bit_identical() -> None:
    engine = Engine(config(lora=LORA, lr=1e-2, faults={"nan_loss_steps": [1]}))
    _steps(engine, 1)
    before = engine.state_digest()
    report = engine.accumulate(engine.rollout())
    assert report.loss != report.loss  # the injected NaN
    engine.flush()
    assert engine.state_digest() == before and engine.step == 2
