"""Every drill on the real engine: each injected step intercepted, no false positive over at
least 50 clean steps, the policy bit-identical after each flush."""

import pytest

from grpod.engine.data.tasks import KVRetrievalTask
from grpod.guards import Action, run_drill

FLUSH_DRILLS = ("nan-loss", "inf-grad", "sentinel-logprob")
WARN_DRILLS = {"equal-rewards": "advantage", "loss-spike": "spike"}


def assert_clean_run(result: dict) -> None:
    assert result["injected"] > 0
    assert result["intercepted"] == result["injected"]
    assert result["false_positives"] == 0
    assert result["clean_steps"] >= 50
    assert result["policy_untouched"] is True
    assert result["ok"] is True


@pytest.mark.parametrize("name", FLUSH_DRILLS)
def test_flush_drills(name: str) -> None:
    result = run_drill(name)
    assert_clean_run(result)
    injected = [r for r in result["findings"] if r["injected"]]
    assert len(injected) == result["injected"] == result["outcomes"]["flushed"]
    for record in injected:
        assert record["outcome"] == "flushed"
        assert any(f["guard"] == "finite" and f["action"] == "FLUSH" for f in record["findings"])


@pytest.mark.parametrize("name", sorted(WARN_DRILLS))
def test_warn_drills(name: str) -> None:
    result = run_drill(name)
    assert_clean_run(result)
    for record in result["findings"]:
        flagged = any(f["guard"] == WARN_DRILLS[name] for f in record["findings"])
        assert flagged == record["injected"], record


def test_unknown_drill_is_a_guards_error() -> None:
    from grpod.guards import GuardsError

    with pytest.raises(GuardsError, match="unknown"):
        run_drill("no-such-drill")


@pytest.mark.slow  # the fast tier stays under ~2 minutes
def test_vtc_last_chunk_strict_flushes_every_faulty_step() -> None:
    result = run_drill("vtc-last-chunk", steps=12, guards={"reorder": {"enabled": False}})
    assert_clean_run(result)
    faulty = [r for r in result["findings"] if r["phase"] == "faulty"]
    assert len(faulty) == result["injected"] == 12
    for record in faulty:
        assert record["outcome"] == "flushed"
        assert record["valid_tokens"] != record["expected_valid_tokens"]
        assert any(f["guard"] == "accounting" for f in record["findings"])
    # the clean phase: the same workload, counted right, never flushed
    assert result["outcomes"]["applied"] == result["clean_steps"]


def test_vtc_last_chunk_nonzero_with_reorder_repairs_mixed_and_skips_all_long() -> None:
    fraction, seed = 0.4, 0
    result = run_drill(
        "vtc-last-chunk",
        steps=14,
        seed=seed,
        clean_steps=0,
        guards={"accounting": {"mode": "nonzero"}},
        engine_overrides={"long_prompt_batch_fraction": fraction},
    )
    assert result["intercepted"] == result["injected"] == 14
    assert result["policy_untouched"] is True
    task = KVRetrievalTask(fraction)
    long_steps = {r["step"] for r in result["findings"] if task.is_long_batch(r["step"], seed)}
    assert long_steps, "the run should draw some all-long-prompt batches"
    repaired = 0
    for record in result["findings"]:
        if record["step"] in long_steps:
            assert record["outcome"] == "skipped"
            assert record["findings"][0]["guard"] == "reorder"
            assert Action[record["findings"][0]["action"]] >= Action.FLUSH
        elif record["outcome"] == "applied":
            assert record["valid_tokens"] > 0  # the counter reads the moved micro's chunk 0
            repaired += 1
    assert repaired >= 1 and repaired == result["repaired"]
    assert result["skip_fast_total"] == result["outcomes"]["skipped"] >= len(long_steps)


@pytest.mark.slow  # two 24-step runs of W1c's shape
def test_reward_hacking_drill_warns_at_onset_and_not_on_the_honest_twin() -> None:
    result = run_drill("reward-hacking", steps=24)
    assert result["ok"] is True, {k: result[k] for k in ("onset_step", "first_warn_step")}
    assert result["false_positives"] == 0 and result["honest_findings"] == []
    assert 0 <= result["steps_to_warn"] <= result["onset_within"]
    assert result["finding"]["kind"] == "divergence"
    example = result["example"]
    assert example["reward"] == 1.0 and list(example["audits"].values()) == [0.0]
