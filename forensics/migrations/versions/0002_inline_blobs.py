"""Small blobs inline: `blobs.data` holds a blob's safetensors bytes instead of a file.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    op.add_column("blobs", sa.Column("data", sa.LargeBinary, nullable=True))


def downgrade() -> None:
    inline = op.get_bind().scalar(sa.text("SELECT count(*) FROM blobs WHERE data IS NOT NULL"))
    if inline:  # their bytes exist nowhere else: refuse rather than lose them
        raise RuntimeError(f"downgrade 0002: {inline} blobs are stored inline; nothing changed")
    with op.batch_alter_table("blobs") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("data")
