"""block scale exponent histograms of block-scaled tensors (MXFP8, FP8 block scaling), per tensor and step,
and summed per block of steps once the steps are compacted

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "block_histograms",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("tensor", sa.Integer(), nullable=False),
        sa.Column("level", sa.SmallInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("lo", sa.SmallInteger(), nullable=False),
        sa.Column("n_steps", sa.Integer(), nullable=False),
        sa.Column("counts", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "tensor", "level", "step"),
    )


def downgrade() -> None:
    op.drop_table("block_histograms")
