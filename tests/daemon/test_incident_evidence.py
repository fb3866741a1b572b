"""`grpod incidents show` draws a finding's curves (quarter means and trend t) on one line."""

from __future__ import annotations

from grpod.guards.trend import evidence_lines


def test_curves_on_one_line_each_other_numbers_as_they_are() -> None:
    evidence = {
        "audit_q1": 0.0, "audit_q2": 0.01, "audit_q3": 0.0, "audit_q4": 0.02, "audit_t": 1.5,
        "trained_q1": 0.25, "trained_q2": 0.5, "trained_q3": 0.75, "trained_q4": 1.0,
        "trained_t": 13.0, "example_sample": 3.0, "held_steps": 3.0,
    }  # fmt: skip
    assert evidence_lines(evidence) == [
        "audit over the window (quarter means): 0 -> 0.01 -> 0 -> 0.02 (trend t 1.5)",
        "trained over the window (quarter means): 0.25 -> 0.5 -> 0.75 -> 1 (trend t 13)",
        "example_sample = 3.0",
        "held_steps = 3.0",
    ]
    assert evidence_lines({"valid_tokens": 0.0}) == ["valid_tokens = 0.0"]
