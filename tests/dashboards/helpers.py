"""Shared pieces of the dashboard tests: file paths, promtool, the metric contract, and a
small PromQL scanner that finds the metric names an expression reads."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
DASHBOARD_JSON = DASHBOARDS / "grafana" / "grpod.json"
ALERTS = DASHBOARDS / "prometheus" / "alerts.yml"
ALERTS_TEST = DASHBOARDS / "prometheus" / "alerts_test.yml"
PROMETHEUS_YML = DASHBOARDS / "prometheus" / "prometheus.yml"

# The daemon's metric families (the contract): name -> type. Histograms and counters are
# exposed with their sample suffixes (_bucket/_sum/_count, _total).
CONTRACT: dict[str, str] = {
    "grpod_step": "gauge",
    "grpod_steps_total": "counter",
    "grpod_loss": "gauge",
    "grpod_reward_mean": "gauge",
    "grpod_reward_std": "gauge",
    "grpod_kl": "gauge",
    "grpod_policy_entropy_nats": "gauge",
    "grpod_valid_tokens": "gauge",
    "grpod_expected_valid_tokens": "gauge",
    "grpod_grad_norm": "gauge",
    "grpod_clip_coefficient": "gauge",
    "grpod_learning_rate": "gauge",
    "grpod_zero_std_group_fraction": "gauge",
    "grpod_clip_fraction": "gauge",
    "grpod_sampler_mismatch_p90_nats": "gauge",
    "grpod_sampler_mismatch_p99_nats": "gauge",
    "grpod_sampler_mismatch_fraction": "gauge",
    "grpod_weight_version": "gauge",
    "grpod_weight_sync_max_abs_logprob_diff": "gauge",
    "grpod_weight_sync_seconds": "histogram",
    "grpod_rollout_staleness_steps": "histogram",
    "grpod_step_rollout_staleness_steps": "gauge",
    "grpod_rollout_dropped_total": "counter",
    "grpod_rollout_overlap_seconds_total": "counter",
    "grpod_gradnorm_vtc_correlation": "gauge",
    "grpod_findings_total": "counter",
    "grpod_incidents_total": "counter",
    "grpod_incident_steps_total": "counter",
    "grpod_incidents_open": "gauge",
    "grpod_incident_attributions_total": "counter",
    "grpod_incident_attribution_timestamp_seconds": "gauge",
    "grpod_phase_duration_seconds": "histogram",
    "grpod_completion_tokens_total": "counter",
    "grpod_completions_total": "counter",
    "grpod_last_step_timestamp_seconds": "gauge",
    "grpod_recorder_queue_depth": "gauge",
    "grpod_recorder_uncommitted_steps": "gauge",
    "grpod_recorder_blocked_total": "counter",
    "grpod_retained_bytes": "gauge",
    "grpod_retention_over_budget_bytes": "gauge",
    "grpod_pruned_bytes_total": "counter",
    "grpod_pruned_total": "counter",
    "grpod_global_valid_tokens": "gauge",
    "grpod_rank_up": "gauge",
    "grpod_rank_step": "gauge",
    "grpod_rank_valid_tokens": "gauge",
    "grpod_rank_expected_valid_tokens": "gauge",
    "grpod_rank_last_step_timestamp_seconds": "gauge",
    "grpod_rank_phase_duration_seconds": "gauge",
    "grpod_halted": "gauge",
    "grpod_verdict_action": "gauge",
    "grpod_build_info": "gauge",
    "grpod_kv_cache_evicted_prompt_tokens": "gauge",
    "grpod_kv_cache_fill_ratio": "gauge",
    "grpod_kv_cache_slots": "gauge",
    "grpod_kv_cache_protected_tokens": "gauge",
    "grpod_reward_function_mean": "gauge",
    "grpod_reward_function_std": "gauge",
    "grpod_eval_reward": "gauge",
    "grpod_eval_step": "gauge",
    "grpod_audit_reward_mean": "gauge",
    "grpod_completion_degeneration_ratio": "gauge",
    "grpod_reward_hacking_rule_action": "gauge",
}
# Series Prometheus itself attaches to every target.
SYNTHETIC = {"up"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# Grafana's built-in variables, and values to substitute when promtool parses a panel query.
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s"}
SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range": "1h",
    "$job": "grpod",
    "$instance": ".+",
}

_PROMQL_KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan", "sum", "min", "max", "avg", "count",
    "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
}  # fmt: skip


def promtool() -> str:
    """Path of promtool: `.tools/promtool` (make promtool), else PATH. Under CI=true a
    missing promtool fails the test instead of skipping it."""
    local = ROOT / ".tools" / "promtool"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which("promtool")
    if found:
        return found
    message = "promtool not found: run `make promtool` (scripts/install_promtool.sh .tools)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_JSON.read_text())


def load_alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def panel_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every panel target and every Prometheus annotation."""
    exprs = [
        (panel["title"], target["expr"])
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    exprs += [
        (f"annotation {a['name']}", a["expr"])
        for a in dashboard["annotations"]["list"]
        if "expr" in a
    ]
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (sample names, e.g. `_bucket`)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.$])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name in _PROMQL_KEYWORDS:
            continue
        names.add(name)
    return names


def metric_uses() -> set[tuple[str, str]]:
    """(where, metric name) for every metric the dashboard's queries (where: the panel title)
    and the alert rules (where: the alert) read."""
    used = {
        (title, name)
        for title, expr in panel_exprs(load_dashboard())
        for name in metric_names(expr)
    }
    used |= {(r["alert"], name) for r in load_alert_rules() for name in metric_names(r["expr"])}
    return used


def shown_families() -> set[str]:
    """The contract families the dashboard's queries read."""
    return {family(n) for _, expr in panel_exprs(load_dashboard()) for n in metric_names(expr)}


def family(sample_name: str) -> str:
    """The contract family of a sample name (`grpod_phase_duration_seconds_bucket` ->
    `grpod_phase_duration_seconds`); unknown names come back unchanged."""
    if sample_name in CONTRACT:
        return sample_name
    for suffix in HISTOGRAM_SUFFIXES:
        base = sample_name.removesuffix(suffix)
        if base != sample_name and CONTRACT.get(base) == "histogram":
            return base
    return sample_name


def substitute(expr: str) -> str:
    """A dashboard query with Grafana variables replaced by concrete values."""
    for var, value in sorted(SUBSTITUTIONS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace("${" + var[1:] + "}", value).replace(var, value)
    return expr
