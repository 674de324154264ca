"""run tags, the names of the scalars a run sent, and an index on the runs' status for the filtered runs list

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_tags",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("tag", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "tag"),
    )
    op.create_index("ix_run_tags_tag", "run_tags", ["tag"])
    op.create_index("ix_runs_status", "runs", ["status"])
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("scalar_names", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("scalar_names")
    op.drop_index("ix_runs_status", table_name="runs")
    op.drop_index("ix_run_tags_tag", table_name="run_tags")
    op.drop_table("run_tags")
