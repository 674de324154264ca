"""runs.client_key: idempotent run registration

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 15:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("client_key", sa.String(length=100), nullable=True))
        batch_op.create_index("uq_runs_client_key", ["client_key"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index("uq_runs_client_key")
        batch_op.drop_column("client_key")
