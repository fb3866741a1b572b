"""FSDP2 and DDP under a real `torchrun --nproc-per-node 2` (gloo, CPU) against one process.

The 2-rank step and the one-process step on the same global batch (both ranks' batches, one
after the other) agree on loss, valid tokens, grad norm and the updated weights to FP32
rounding; a fault on rank 1 only flushes the step on both ranks, weights untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpod.engine import Engine, EngineConfig, EngineError, StepReport, TransportBatch
from tests.engine.parallel_worker import CONFIG, MODES

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[3]
TORCHRUN = Path(sys.executable).with_name("torchrun")
# measured on this CPU (torch 2.13, gloo): loss, grad norm and weights bit-identical; allowed:
RTOL, WEIGHTS_ATOL = 1e-5, 1e-6


def torchrun(module: str, out: Path, nproc: int = 2, timeout: float = 240) -> list[dict]:
    """Run `module` under a real torchrun; every rank's `out/result-RANK.json`, by rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [
            *(str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc)),
            *("--log-dir", str(out / "torchelastic"), "-m", module, str(out)),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"result-{rank}.json").read_text()) for rank in range(nproc)]


def test_two_ranks_equal_one_process_and_a_rank_1_fault_flushes_both(tmp_path) -> None:
    ranks = torchrun("tests.engine.parallel_worker", tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        initial = Engine(EngineConfig.model_validate({**CONFIG, "faults": {}})).state_dict()
    for mode in MODES:
        for r in ranks:
            steps = r["modes"][mode]
            assert [s["outcome"] for s in steps] == ["applied", "flushed", "flushed", "applied"]
            assert [s["untouched"] for s in steps] == [False, True, True, False]
            assert all("finite" in s["guards"] for s in steps[1:3])
        _equals_one_process(tmp_path / mode, mode, initial)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = Engine(EngineConfig.model_validate({**CONFIG, "faults": {}}))
        engine.load_checkpoint(tmp_path / mode / "checkpoint")  # one process reads DCP
        final = load_file(str(tmp_path / mode / "final.safetensors"))
        assert all(torch.equal(p, final[n]) for n, p in engine.model.named_parameters()), mode


def _equals_one_process(out: Path, mode: str, initial: dict) -> None:
    reports = [
        StepReport.from_dict(json.loads((out / f"report-{r}.json").read_text())) for r in (0, 1)
    ]
    batches = [TransportBatch.load(out / f"batch-{r}.safetensors") for r in (0, 1)]
    assert [(b.rank, b.world_size) for b in batches] == [(0, 2), (1, 2)]
    assert set(batches[0].group_ids.unique().tolist()) - {-1} == {0, 1}  # whole groups per rank
    assert set(batches[1].group_ids.unique().tolist()) - {-1} == {2, 3}
    for r, report in enumerate(reports):
        assert report.valid_tokens == batches[r].expected_valid_tokens()
        assert report.rank_expected_valid_tokens == [b.expected_valid_tokens() for b in batches]
        assert report.global_valid_tokens == sum(report.rank_expected_valid_tokens)
    assert reports[0].loss == reports[1].loss and reports[0].grad_norm == reports[1].grad_norm
    assert abs(reports[0].local_loss + reports[1].local_loss - reports[0].loss) < 1e-6

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Engine(EngineConfig.model_validate({**CONFIG, "faults": {}}))
    assert engine.parallel.world_size == 1 and not engine.parallel.distributed
    engine.load_state_dict(initial)
    one = engine.accumulate(TransportBatch.concat(batches))
    engine.apply()
    assert one.valid_tokens == reports[0].global_valid_tokens
    assert abs(one.loss - reports[0].loss) <= RTOL * abs(one.loss)
    assert abs(one.grad_norm - reports[0].grad_norm) <= RTOL * one.grad_norm
    rank_weights = [load_file(str(out / f"weights-{r}.safetensors")) for r in (0, 1)]
    assert set(rank_weights[0]) == {n for n, _ in engine.model.named_parameters()}
    worst = max(
        float((p.detach() - weights[n]).abs().max())
        for weights in rank_weights
        for n, p in engine.model.named_parameters()
    )
    print(
        f"{mode}: loss {one.loss!r} vs {reports[0].loss!r}; grad norm {one.grad_norm!r} vs "
        f"{reports[0].grad_norm!r}; weights max |diff| {worst:.3g}"
    )
    assert worst <= WEIGHTS_ATOL, worst


def test_the_torchrun_environment_is_checked_before_anything_is_built(monkeypatch) -> None:
    from grpod.engine.model.parallel import Parallel

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(EngineError, match="prompts_per_step: 4 groups do not split evenly over 3"):
        Parallel.start(EngineConfig.model_validate(CONFIG))
    alone = Parallel.start(EngineConfig.model_validate({**CONFIG, "parallel": "none"}))
    assert (alone.mode, alone.rank, alone.world_size) == ("none", 0, 1)
    # a torchrun run's config in one process (replay --rank, a one-process resume): no group
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    for mode in ("fsdp2", "ddp"):
        one = Parallel.start(EngineConfig.model_validate({**CONFIG, "parallel": mode}))
        assert (one.mode, one.world_size) == ("none", 1)


def test_auto_is_the_ranks_cuda_device_when_there_is_one_else_the_cpu() -> None:
    from grpod.engine.model.parallel import Parallel

    rank_1 = Parallel("fsdp2", rank=1, world_size=2, local_rank=1)
    assert rank_1.device("auto") == ("cuda:1" if torch.cuda.is_available() else "cpu")
    assert rank_1.device("cuda") == "cuda:1" and rank_1.device("cpu") == "cpu"
    assert Parallel("none").device("auto") == "auto"  # one process: resolve_device decides


def test_config_check_under_a_sharding_world_takes_lora_and_refuses_an_uneven_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`grpod run` preflights the same way on every rank (and in the agent) before anything is
    created; `config check` with torchrun's WORLD_SIZE shows it without a process group."""
    from grpod.daemon.cli import main
    from tests.daemon.helpers import write_config

    config = write_config(
        tmp_path / "grpod.toml", {"engine": dict(CONFIG), "engine.lora": {"rank": 4}}
    )
    uneven = write_config(tmp_path / "uneven.toml", {"engine": {**CONFIG, "prompts_per_step": 3}})
    monkeypatch.setenv("WORLD_SIZE", "2")
    for parallel in ("fsdp2", "ddp"):
        text = config.read_text().replace("[engine]\n", f'[engine]\nparallel = "{parallel}"\n')
        config.write_text(text)
        assert main(["config", "check", str(config)]) == 0  # LoRA under fsdp2 and ddp
        config.write_text(text.replace(f'parallel = "{parallel}"\n', ""))
    capsys.readouterr()
    assert main(["config", "check", str(uneven)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3 groups do not split evenly over 2 ranks" in err[0], err
