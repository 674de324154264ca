"""incident replays: the verdict and evidence of a replayed incident, one per incident

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-10 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a new table only: nothing existing is rebuilt (the incidents keep their AUTOINCREMENT ids)
    op.create_table(
        "incident_replays",
        sa.Column("incident_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("verdict", sa.String(length=32), nullable=False),
        sa.Column("report", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(length=200), nullable=False),
        sa.ForeignKeyConstraint(["incident_id"], ["incidents.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("incident_id"),
    )
    op.create_index("ix_incident_replays_run", "incident_replays", ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_incident_replays_run", table_name="incident_replays")
    op.drop_table("incident_replays")
