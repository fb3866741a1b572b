"""Columns that several revisions create alike: a row id, and the id, run and step that every
per-run table (steps, checkpoints, incidents, evals) opens with. Functions, so that each table
gets Column objects of its own.

Frozen like the revisions that call it: a released revision's schema never changes, so a
change here is a new function, never an edit (tests/forensics/test_schema.py pins the schema
a fresh store reaches).
"""

from __future__ import annotations

import sqlalchemy as sa


def row_id() -> sa.Column:
    """`id`: the table's autoincrement integer primary key."""
    return sa.Column("id", sa.Integer, primary_key=True, autoincrement=True)


def run_step_columns() -> tuple[sa.Column, ...]:
    """`id`, then `run_id` (its run; the row goes with it) and `step`."""
    return (
        row_id(),
        sa.Column(
            "run_id", sa.String(128), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("step", sa.Integer, nullable=False),
    )
