"""Incidents are episodes: a step range, a count and a worst step; steps keep the entropy.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

Incidents written before it (one per step) read as closed episodes of one step.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"

TS = sa.DateTime(timezone=True)
COLUMNS = (
    ("guard", sa.String(64), None),
    ("kind", sa.String(64), None),
    ("last_step", sa.Integer, None),
    ("steps_count", sa.Integer, "1"),
    ("worst_step", sa.Integer, None),
    ("worst_step_id", sa.Integer, None),
    ("worst_checkpoint_id", sa.Integer, None),
    ("status", sa.String(8), "closed"),
    ("closed_at", TS, None),
)


def upgrade() -> None:
    op.add_column("steps", sa.Column("entropy", sa.Float, nullable=True))
    for name, kind, default in COLUMNS:
        op.add_column(
            "incidents",
            sa.Column(name, kind, nullable=default is None, server_default=default),
        )


def downgrade() -> None:
    episodes = op.get_bind().scalar(
        sa.text("SELECT count(*) FROM incidents WHERE guard IS NOT NULL")
    )
    if episodes:  # their step ranges exist nowhere else: refuse rather than lose them
        raise RuntimeError(f"downgrade 0003: {episodes} incidents are episodes; nothing changed")
    with op.batch_alter_table("incidents") as batch:  # SQLite drops a column by copying
        for name, _, _ in reversed(COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("entropy")
