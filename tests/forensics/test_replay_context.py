"""Replay under the recorded execution context: each step records what decides its floats
(engine/context.py); replay sets what it can and names what it cannot, never "transient"."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import select, update

from grpod.forensics import Store, replay
from grpod.forensics.models import Step
from tests.forensics.campaign import Campaign, run_campaign
from tests.forensics.test_store import _migrate

OTHER_CAPABILITY = "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "AVX512"


def _copy(recorded: Campaign, where: Path) -> Path:
    run = where / "run"
    shutil.copytree(recorded.run_dir, run)
    return run


def _edit_steps(run: Path, context: dict[str, Any], grad_norm_scale: float = 1.0) -> None:
    """Every step record's context fields set to `context`; step 11's recorded grad norm
    times `grad_norm_scale` (what another machine's record of it might read)."""
    store = Store(run)
    with store.session() as session:
        for row in session.scalars(select(Step)).all():
            values: dict[str, Any] = {
                "context_json": json.dumps({**json.loads(row.context_json), **context})
            }
            if row.step == 11 and grad_norm_scale != 1.0:
                report = json.loads(row.report_json)
                report["grad_norm"] *= grad_norm_scale
                values["report_json"] = json.dumps(report)
            session.execute(update(Step).where(Step.id == row.id).values(**values))
    store.close()


def test_every_step_records_the_context_it_ran_under(recorded: Campaign) -> None:
    store = Store(recorded.run_dir, create=False)
    with store.session() as session:
        contexts = [json.loads(c) for c in session.scalars(select(Step.context_json))]
    store.close()
    assert len(contexts) == 13
    for context in contexts:
        assert context["threads"] == 1  # the campaign's torch.set_num_threads(1)
        assert context["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        assert context["torch"] == torch.__version__ and context["device"] == "cpu"
        assert context["deterministic"] == "off" and context["matmul_precision"] == "highest"


def test_replay_sets_the_recorded_threads_and_gives_the_shell_its_own_back(
    tmp_path: Path,
) -> None:
    shell = torch.get_num_threads()
    run = run_campaign(tmp_path / "run", 3, threads=0)  # at the campaign's 1 thread
    torch.set_num_threads(3)
    try:
        result = replay(run.run_dir, step=2)
        assert torch.get_num_threads() == 3  # the shell's again once the replay ends
    finally:
        torch.set_num_threads(shell)
    assert result.reproduced is True and result.classification == "healthy"
    assert result.context["restored"] == {"threads": {"recorded": 1, "shell": 3}}
    assert result.context["recorded"] and not result.context["differs"]
    assert result.context["notes"] == ["context restored: threads 1 (the shell's 3)"]
    assert not result.note


def test_a_capability_that_cannot_be_restored_is_named_with_a_tolerance_verdict(
    recorded: Campaign, tmp_path: Path
) -> None:
    run = _copy(recorded, tmp_path)
    _edit_steps(run, {"cpu_capability": OTHER_CAPABILITY}, grad_norm_scale=1 + 4e-7)
    result = replay(run, step=11)
    now = torch.backends.cpu.get_cpu_capability()
    why = f"context differs: cpu_capability recorded {OTHER_CAPABILITY!r}, replayed {now!r}"
    assert result.reproduced == f"within 1e-6 ({why})"
    assert result.classification == "healthy"
    assert result.context["differs"] == [
        {"field": "cpu_capability", "recorded": OTHER_CAPABILITY, "replayed": now, "decides": True}
    ]
    (line,) = result.context["notes"]
    assert line.startswith(f"{why} (cannot be restored in a running process")


def test_beyond_the_tolerance_in_another_context_is_inconclusive_not_transient(
    recorded: Campaign, tmp_path: Path
) -> None:
    run = _copy(recorded, tmp_path)
    _edit_steps(run, {"torch": "2.0.0"}, grad_norm_scale=1.001)
    result = replay(run, step=11)
    assert not result.reproduced and result.classification == "inconclusive"
    assert (result.diverged_at, result.field) == (11, "grad_norm")
    assert result.note.startswith(
        f"diverged in grad_norm: beyond 1e-6 (context differs: torch recorded '2.0.0', "
        f"replayed {torch.__version__!r})"
    )
    # the same record in the same context: a fault that did not come back
    _edit_steps(run, {"torch": torch.__version__})
    assert replay(run, step=11).classification == "transient"


def test_a_field_that_does_not_decide_the_numbers_is_named_and_stays_bit_exact(
    recorded: Campaign, tmp_path: Path
) -> None:
    run = _copy(recorded, tmp_path)
    _edit_steps(run, {"vllm": "0.1.0"})
    result = replay(run, step=11)
    assert result.reproduced is True and result.classification == "healthy"
    assert result.context["differs"][0]["field"] == "vllm"
    assert result.context["notes"] == [
        "context differs: vllm recorded '0.1.0', replayed '' (does not change the trainer's "
        "numbers)"
    ]


def test_a_store_before_contexts_upgrades_and_replays_as_before(
    recorded: Campaign, tmp_path: Path
) -> None:
    run = _copy(recorded, tmp_path)
    store = Store(run)
    _migrate(store, "downgrade", "0005")  # the store as the grpod before 0006 wrote it
    assert store.upgrade() == "0008_incident_samples"
    with store.session() as session:
        assert set(session.scalars(select(Step.context_json))) == {None}
    store.close()
    result = replay(run, step=11)
    assert result.reproduced is True and result.context["recorded"] is False
    assert "2 step(s) recorded without an execution context" in result.context["notes"][0]
    assert math.isfinite(float(result.replayed["grad_norm"]))
