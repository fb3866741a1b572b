"""The Metrics object on a registry of its own: names and values from a StepReport."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from grpod.daemon.metric_families import PHASE_BUCKETS
from grpod.daemon.metrics import Metrics
from grpod.engine import Outcome, StepReport, StepResult
from grpod.engine.report import KVCacheReport
from grpod.guards import Action, Finding, Verdict
from tests.daemon.helpers import parse_metrics
from tests.reports import make_report

CONTRACT_NAMES = [
    "grpod_step",
    "grpod_steps_total",
    "grpod_loss",
    "grpod_reward_mean",
    "grpod_reward_std",
    "grpod_kl",
    "grpod_valid_tokens",
    "grpod_expected_valid_tokens",
    "grpod_grad_norm",
    "grpod_clip_coefficient",
    "grpod_learning_rate",
    "grpod_zero_std_group_fraction",
    "grpod_clip_fraction",
    "grpod_sampler_mismatch_p90_nats",
    "grpod_sampler_mismatch_p99_nats",
    "grpod_sampler_mismatch_fraction",
    "grpod_gradnorm_vtc_correlation",
    "grpod_findings_total",
    "grpod_incidents_total",
    "grpod_incident_steps_total",
    "grpod_incidents_open",
    "grpod_policy_entropy_nats",
    "grpod_phase_duration_seconds",
    "grpod_completion_tokens_total",
    "grpod_completions_total",
    "grpod_last_step_timestamp_seconds",
    "grpod_recorder_queue_depth",
    "grpod_recorder_uncommitted_steps",
    "grpod_recorder_blocked_total",
    "grpod_halted",
    "grpod_verdict_action",
    "grpod_build_info",
    "grpod_kv_cache_evicted_prompt_tokens",
    "grpod_kv_cache_fill_ratio",
    "grpod_kv_cache_slots",
    "grpod_kv_cache_protected_tokens",
]


ENGINE_PHASES = {"rollout": 0.04, "score": 0.0, "grad": 0.06, "optim": 0.01}


def report(step: int = 3, **overrides: object) -> StepReport:
    values = dict(
        valid_tokens=50,
        expected_valid_tokens=52,
        loss=0.25,
        micro_losses=[0.25],
        grad_norm=2.0,
        clip_coef=0.5,
        reward_mean=0.75,
        reward_std=0.4,
        advantage_abs_max=1.5,
        clip_fraction_low=0.01,
        clip_fraction_high=0.02,
        mismatch_mean=0.01,
        mismatch_p90=0.03,
        mismatch_p99=0.09,
        mismatch_max=0.2,
        mismatch_frac_above_0_1=0.005,
        completion_length_mean=3.5,
        num_samples=16,
        entropy=0.42,
    )
    return make_report(step=step, **{**values, **overrides})


def decided(
    report: StepReport, verdict: Verdict, outcome: str, phases: dict[str, float]
) -> StepResult:
    """A decided step as the loop hands it to the metrics (they read no batch)."""
    return StepResult(None, report, verdict, Outcome(outcome), phases)  # type: ignore[arg-type]


def test_every_contract_name_and_the_values() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry, {"grpod": "0.1.0", "torch": "2", "transformers": "5"})
    verdict = Verdict(Action.WARN, [Finding("accounting", Action.WARN, "vtc != mask", {})])
    phases = {**ENGINE_PHASES, "guards": 0.001, "record": 0.0002}
    metrics.observe_step(decided(report(), verdict, "applied", phases), 0.83, now=1234.0)
    metrics.observe_recorder(queue_depth=2, blocked_total=1, incidents_total=1, uncommitted_steps=5)
    metrics.observe_recorder(queue_depth=0, blocked_total=1, incidents_total=3, uncommitted_steps=7)
    metrics.observe_recorder(0, 1, 3, 7, incident_steps_total=40, incidents_open=2)
    metrics.observe_recorder(0, 1, 3, 7, incident_steps_total=41, incidents_open=1)
    text = generate_latest(registry).decode()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert set(CONTRACT_NAMES) <= names, set(CONTRACT_NAMES) - names
    values = parse_metrics(text)
    assert values["grpod_step"] == 3 and values["grpod_loss"] == 0.25
    assert values["grpod_valid_tokens"] == 50 and values["grpod_expected_valid_tokens"] == 52
    assert values["grpod_clip_coefficient"] == 0.5 and values["grpod_learning_rate"] == 1e-3
    assert math.isnan(values["grpod_kl"])  # off in the report
    assert values['grpod_clip_fraction{side="high"}'] == 0.02
    assert values["grpod_sampler_mismatch_p99_nats"] == 0.09
    assert values["grpod_gradnorm_vtc_correlation"] == 0.83
    assert values['grpod_steps_total{outcome="applied"}'] == 1
    assert values['grpod_steps_total{outcome="flushed"}'] == 0
    assert values['grpod_findings_total{action="WARN",guard="accounting"}'] == 1
    assert values["grpod_verdict_action"] == 1
    assert values["grpod_completions_total"] == 16 and values["grpod_completion_tokens_total"] == 56
    assert values["grpod_incidents_total"] == 3 and values["grpod_recorder_blocked_total"] == 1
    assert values["grpod_recorder_queue_depth"] == 0
    assert values["grpod_incident_steps_total"] == 41 and values["grpod_incidents_open"] == 1
    assert values["grpod_policy_entropy_nats"] == 0.42
    assert values["grpod_recorder_uncommitted_steps"] == 7
    assert values["grpod_last_step_timestamp_seconds"] == 1234.0
    assert values['grpod_build_info{torch="2",transformers="5",version="0.1.0"}'] == 1
    assert values['grpod_phase_duration_seconds_count{phase="guards"}'] == 1
    le = [
        k
        for k in values
        if k.startswith("grpod_phase_duration_seconds_bucket{") and 'phase="grad"' in k
    ]
    assert len(le) == len(PHASE_BUCKETS) + 1
    assert math.isnan(values["grpod_kv_cache_evicted_prompt_tokens"])  # the dense cache
    assert math.isnan(values['grpod_kv_cache_slots{policy="dense"}'])


def test_a_bounded_rollout_cache_publishes_its_settings_and_evictions() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    kv = KVCacheReport("h2o", 256, 16, 4, prompt_tokens_evicted=3072.0, fill=0.875)
    metrics.observe_step(decided(report(kv_cache=kv), Verdict(Action.PASS, []), "applied", {}))
    values = parse_metrics(generate_latest(registry).decode())
    assert values["grpod_kv_cache_evicted_prompt_tokens"] == 3072.0
    assert values["grpod_kv_cache_fill_ratio"] == 0.875
    assert values['grpod_kv_cache_slots{policy="h2o"}'] == 256
    assert values['grpod_kv_cache_protected_tokens{kind="sink"}'] == 16
    assert values['grpod_kv_cache_protected_tokens{kind="grace"}'] == 4


def test_skipped_step_counts_no_completions() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    skipped = report(skipped_compute=True)
    metrics.observe_step(decided(skipped, Verdict(Action.FLUSH, []), "skipped", {"guards": 0.0}))
    values = parse_metrics(generate_latest(registry).decode())
    assert values['grpod_steps_total{outcome="skipped"}'] == 1
    assert values["grpod_completions_total"] == 0


RANK = """
import sys; sys.path[:0] = {path!r}
from prometheus_client import CollectorRegistry
from grpod.daemon.metrics import Metrics, RankMetrics
from grpod.guards import Action, Verdict
from tests.daemon.test_metrics import decided, report
registry, rank = CollectorRegistry(), {rank}
PASS = Verdict(Action.PASS, [])
mine = report(step=5, valid_tokens=100 + rank, expected_valid_tokens=100 + rank)
if rank == 0:  # rank 0 alone publishes the step's numbers
    Metrics(registry).observe_step(decided(mine, PASS, "applied", {{"grad": 0.1}}))
RankMetrics(registry, rank).observe(decided(mine, PASS, "applied", {{"grad": 0.5 + rank}}))
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow  # the fast tier stays under ~2 minutes
def test_multiprocess_mode_serves_every_rank_and_marks_a_dead_one(tmp_path: Path) -> None:
    """Under torchrun every rank writes the node's PROMETHEUS_MULTIPROC_DIR, local rank 0
    serves them all: the step's numbers once (rank 0's), each rank's labelled, and a rank
    whose process is gone shows `grpod_rank_up` 0."""
    from grpod.daemon.metrics import prepare_multiproc_dir

    path = tmp_path / "prometheus" / "node-0"
    path.mkdir(parents=True)
    (path / "counter_99999999.db").write_bytes(b"an earlier start's")
    prepare_multiproc_dir(path)  # local rank 0, before any rank creates a metric
    assert list(path.iterdir()) == []
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(path)}
    ranks = []
    for rank in (0, 1):
        child = subprocess.Popen(
            [sys.executable, "-c", RANK.format(path=sys.path, rank=rank)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout.readline().strip() == "ready"
        ranks.append(child)
    try:
        ranks[1].kill()  # SIGKILL: no clean-up of its own
        ranks[1].wait(timeout=10)
        from grpod.daemon.metrics import serving_registry

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
        try:
            text = generate_latest(serving_registry(CollectorRegistry())).decode()
        finally:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
    finally:
        ranks[0].communicate("", timeout=10)
    values = parse_metrics(text)
    assert values["grpod_step"] == 5 and values["grpod_loss"] == 0.25
    assert values['grpod_steps_total{outcome="applied"}'] == 1  # not once per rank
    assert values['grpod_rank_up{rank="0"}'] == 1 and values['grpod_rank_up{rank="1"}'] == 0
    assert [values[f'grpod_rank_valid_tokens{{rank="{r}"}}'] for r in (0, 1)] == [100, 101]
    assert values['grpod_rank_phase_duration_seconds{phase="grad",rank="1"}'] == 1.5
    assert values['grpod_rank_step{rank="1"}'] == 5
    assert "pid=" not in text
