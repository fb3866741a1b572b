"""The execution context of each step: `steps.context_json` (engine/context.py).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03

Torch threads, the CPU capability, deterministic settings, library versions and the device:
what decides whether a replay of the step is bit-exact. Steps recorded before it have NULL,
which replay reports as "context not recorded" and compares as before.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    op.add_column("steps", sa.Column("context_json", sa.Text, nullable=True))


def downgrade() -> None:
    # a plain ALTER TABLE DROP COLUMN (SQLite >= 3.35): a batch copy of `steps` would drop
    # the table that incidents and step_ranks refer to
    op.drop_column("steps", "context_json")
