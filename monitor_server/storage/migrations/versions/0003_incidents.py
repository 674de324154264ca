"""incidents: alerts that share a cause, and the alerts' incident and onset step

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "incidents",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("root_alert_id", sa.Integer(), nullable=True),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("alert_count", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("notified_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("acknowledged_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("acknowledged_by", sa.String(length=200), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_incidents_run_state", "incidents", ["run_id", "state"], unique=False)
    # plain ADD COLUMN (no table rebuild on SQLite, which keeps the partial unique index as it is)
    op.add_column("alerts", sa.Column("incident_id", sa.Integer(), nullable=True))
    op.add_column("alerts", sa.Column("onset_step", sa.BigInteger(), nullable=True))
    op.create_index("ix_alerts_incident", "alerts", ["incident_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_alerts_incident", table_name="alerts")
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.drop_column("onset_step")
        batch_op.drop_column("incident_id")
    op.drop_index("ix_incidents_run_state", table_name="incidents")
    op.drop_table("incidents")
