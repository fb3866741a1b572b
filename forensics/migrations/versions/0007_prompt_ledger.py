"""The prompt ledger: `prompt_ledger`, one row per prompt of every decided step and eval
(forensics/ledger.py).

Revision ID: 0007_prompt_ledger
Revises: 0006
Create Date: 2026-12-03

Stores before it have no ledger: `grpod fsck` says so and checks nothing there.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from grpod.forensics.migrations.columns import run_step_columns

revision = "0007_prompt_ledger"
down_revision = "0006"


def upgrade() -> None:
    op.create_table(
        "prompt_ledger",
        *run_step_columns(),
        sa.Column("fate", sa.String(16), nullable=False),
        sa.Column("prompt_id", sa.BigInteger, nullable=False),
        sa.Column("epoch", sa.Integer, nullable=True),
        sa.Column("epoch_size", sa.Integer, nullable=True),
        sa.Column("task_row", sa.Integer, nullable=True),
        sa.Column("generation_pass", sa.Integer, nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("stale_drops", sa.Integer, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("superseded", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_prompt_ledger_run_prompt", "prompt_ledger", ["run_id", "prompt_id"])
    op.create_index("ix_prompt_ledger_run_step", "prompt_ledger", ["run_id", "step"])


def downgrade() -> None:
    op.drop_index("ix_prompt_ledger_run_step", table_name="prompt_ledger")
    op.drop_index("ix_prompt_ledger_run_prompt", table_name="prompt_ledger")
    op.drop_table("prompt_ledger")
