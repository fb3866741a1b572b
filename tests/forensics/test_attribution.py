"""Per-sample attribution (`grpod replay --by-sample`) and the poison-sample drill.

Each poisoned campaign is two steps of the tiny model with one sample of step 1 poisoned
(`[engine.faults] poison_sample_*`); the attribution must rank that sample first (and name
the layer of a NaN). Sample 13 of step 1 has a non-zero advantage, two completion tokens and
not the largest healthy share, which the healthy campaign checks.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpod.daemon.cli import main
from grpod.engine.faults import POISON_LOGPROB_SHIFT
from grpod.forensics import ForensicsError, export_incident, list_incidents, replay  # noqa: F401
from grpod.forensics.attribution import STANDS_OUT, attribute, only_sample
from grpod.forensics.step_replay import replay_plan
from grpod.forensics.store import Store
from tests.forensics.campaign import Campaign, run_campaign
from tests.forensics.conftest import FAULT_STEP

GRPOD = str(Path(sys.executable).with_name("grpod"))
STEP, INDEX, LAYER = 1, 13, 2
KINDS = ("nan-logits", "logprob-shift", "loss-scale")
TIS = {"tis_cap": 100.0}  # logprob-shift reaches the gradient only through TIS weights


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Campaign:
    return run_campaign(tmp_path_factory.mktemp("healthy") / "run", STEP + 1)


def _poisoned(root: Path, kind: str, **engine: object) -> Campaign:
    faults = {
        "poison_sample_steps": [STEP],
        "poison_sample_index": INDEX,
        "poison_sample_kind": kind,
        "poison_sample_layer": LAYER,
    }
    return run_campaign(root / "run", STEP + 1, faults=faults, **engine)


@pytest.fixture(scope="module", params=KINDS)
def poisoned(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    kind = request.param
    extra = TIS if kind == "logprob-shift" else {}
    return kind, _poisoned(tmp_path_factory.mktemp(kind), kind, **extra)


def test_healthy_steps_sum_to_the_step_and_nothing_stands_out(healthy: Campaign) -> None:
    for step in (0, STEP):
        result = attribute(healthy.run_dir, step=step)
        report = healthy.reports[step]
        assert result.reproduced and result.residual < 1e-5 and result.nonfinite is None
        assert math.isclose(result.sum_grad_norm, report.grad_norm, rel_tol=1e-5)
        rows = result.samples
        assert sorted(r["index"] for r in rows) == list(range(report.num_samples))
        assert [r["share"] for r in rows] == sorted((r["share"] for r in rows), reverse=True)
        assert math.isclose(sum(r["share"] for r in rows), 1.0, rel_tol=1e-9)
        assert math.isclose(sum(r["projection"] for r in rows), 1.0, abs_tol=1e-5)
        assert math.isclose(sum(r["loss"] for r in rows), report.loss, abs_tol=1e-6)
        assert sum(r["valid_tokens"] for r in rows) == result.valid_tokens == report.valid_tokens
        # the rule: a gradient per unit of data within STANDS_OUT x the step's median
        assert result.stands_out == []
        assert max(r["excess"] for r in rows if r["excess"] is not None) < STANDS_OUT / 2
        assert {r["prompt_id"] for r in rows} == set(range(4 * step, 4 * step + 4))
    mine = next(r for r in result.samples if r["index"] == INDEX)
    assert mine["advantage"] != 0 and mine["completion_length"] == 2
    assert result.samples[0]["index"] != INDEX


def test_the_poisoned_sample_ranks_first(poisoned: tuple) -> None:
    kind, campaign = poisoned
    result = attribute(campaign.run_dir, step=STEP)
    first, second = result.samples[:2]
    assert first["index"] == INDEX and result.injected_faults == ["poison-sample"]
    if kind == "nan-logits":
        assert result.nonfinite == {
            "sample": INDEX,
            "token": 0,
            "part": "completion",
            "module": f"model.layers.{LAYER}.mlp.down_proj",
            "text": f"model.layers.{LAYER}.mlp.down_proj output, sample {INDEX}, "
            "completion token 0",
        }
        assert not first["finite"] and all(r["finite"] for r in result.samples[1:])
        return
    assert result.nonfinite is None and result.stands_out == [INDEX]
    assert first["share"] > 10 * second["share"] and first["excess"] > 10 * STANDS_OUT
    assert result.residual < 1e-5
    if kind == "logprob-shift":
        assert math.isclose(first["max_mismatch"], -POISON_LOGPROB_SHIFT, rel_tol=1e-3)


def test_a_logprob_shift_without_tis_shows_only_as_mismatch(tmp_path: Path) -> None:
    campaign = _poisoned(tmp_path, "logprob-shift")
    result = attribute(campaign.run_dir, step=STEP)
    worst = max(result.samples, key=lambda r: r["max_mismatch"])
    assert worst["index"] == INDEX and worst["max_mismatch"] > 3
    assert result.stands_out == []  # the loss never reads sampler logprobs without TIS


def test_a_nan_loss_is_born_after_every_module(recorded: Campaign) -> None:
    result = attribute(recorded.run_dir, incident_id=1)
    assert result.step == FAULT_STEP and result.outcome == "flushed"
    assert result.nonfinite["module"].startswith("the loss")
    assert result.nonfinite["token"] is None
    assert (
        not result.samples[0]["finite"] and result.samples[0]["index"] == result.nonfinite["sample"]
    )


def test_only_sample_trains_that_sample_alone(healthy: Campaign) -> None:
    store = Store(healthy.run_dir, create=False)
    try:
        *_, plan = replay_plan(store, STEP, None)
    finally:
        store.close()
    batch = plan[-1].batch
    alone = only_sample(batch, INDEX)
    assert alone.loss_mask.sum() == ((batch.sample_ids == INDEX) & batch.loss_mask).sum()
    assert set(alone.sample_ids.unique().tolist()) == {-1, INDEX}
    assert alone.num_micros == batch.num_micros and alone.step == batch.step


@pytest.mark.parametrize("poisoned", ["nan-logits"], indirect=True)  # one CLI run is enough
def test_cli_by_sample_json_and_bad_input(poisoned: tuple, tmp_path: Path) -> None:
    _, campaign = poisoned
    run_dir = str(campaign.run_dir)
    out = subprocess.run(
        [GRPOD, "replay", "--step", str(STEP), "--by-sample", "--json", "--run-dir", run_dir],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert [s["index"] for s in result["samples"]][:1] == [INDEX]
    assert {"index", "prompt_id", "share"} <= set(result["samples"][0])
    assert result["nonfinite"]["sample"] == INDEX
    assert result["nonfinite"]["module"] == f"model.layers.{LAYER}.mlp.down_proj"
    bad = subprocess.run(
        [GRPOD, "replay", "--step", "99", "--by-sample", "--run-dir", run_dir],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "step 99" in bad.stderr
    copy = tmp_path / "run"
    shutil.copytree(campaign.run_dir, copy)
    shutil.rmtree(copy / "checkpoints")
    with pytest.raises(ForensicsError, match="checkpoint"):
        attribute(copy, step=STEP)


@pytest.mark.parametrize("poisoned", ["nan-logits"], indirect=True)  # its flushed step
def test_an_incident_carries_its_attribution(
    poisoned: tuple, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _, campaign = poisoned
    (incident,) = list_incidents(campaign.run_dir)
    assert incident["step"] == STEP
    out = export_incident(campaign.run_dir, incident["id"], tmp_path / "export", by_sample=True)
    exported = json.loads((out / "attribution.json").read_text())
    assert exported["step"] == STEP and exported["samples"][0]["index"] == INDEX
    assert exported["nonfinite"]["module"] == f"model.layers.{LAYER}.mlp.down_proj"
    args = ["incidents", "show", str(incident["id"]), "--run-dir", str(campaign.run_dir)]
    assert main([*args, "--by-sample", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["attribution"]["samples"][0]["index"] == INDEX
    assert main([*args, "--by-sample"]) == 0
    text = capsys.readouterr().out
    assert f"non-finite: born at model.layers.{LAYER}.mlp.down_proj output, sample {INDEX}" in text
