"""policy actions: what a run's remediation policy queued or proposed for a replayed incident, and its check

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-17 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a new table only; its ids are never reused (AUTOINCREMENT on SQLite, a sequence on PostgreSQL)
    op.create_table(
        "policy_actions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("incident_id", sa.Integer(), nullable=True),
        sa.Column("rule", sa.String(length=32), nullable=False),
        sa.Column("target", sa.String(length=300), nullable=False),
        sa.Column("changes", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("command_id", sa.Integer(), nullable=True),
        sa.Column("rollback_id", sa.Integer(), nullable=True),
        sa.Column("loss_before", sa.Float(), nullable=True),
        sa.Column("loss_after", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["incident_id"], ["incidents.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_policy_actions_run_state", "policy_actions", ["run_id", "state"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_policy_actions_run_state", table_name="policy_actions")
    op.drop_table("policy_actions")
