"""Each incident's per-sample attribution: one `incident_attributions` row per incident.

Revision ID: 0008_incident_samples
Revises: 0007_prompt_ledger
Create Date: 2026-12-03

Computed by the daemon off the training path (forensics/incident_attribution.py): the
attribution of the incident's first step as `grpod replay --by-sample --json` prints it
(JSON, never a pickle), or a note saying why there is none (too large, timed out, the daemon
stopped). Incidents before it have no row: `grpod incidents show ID --by-sample` computes one.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from grpod.forensics.migrations.columns import row_id

revision = "0008_incident_samples"
down_revision = "0007_prompt_ledger"


def upgrade() -> None:
    op.create_table(
        "incident_attributions",
        row_id(),
        sa.Column(
            "incident_id",
            sa.Integer,
            sa.ForeignKey("incidents.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("note", sa.Text, nullable=False),
        sa.Column("seconds", sa.Float, nullable=True),
        sa.Column("attribution_json", sa.Text, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index(
        "ux_incident_attributions_incident", "incident_attributions", ["incident_id"], unique=True
    )


def downgrade() -> None:
    op.drop_index("ux_incident_attributions_incident", table_name="incident_attributions")
    op.drop_table("incident_attributions")
