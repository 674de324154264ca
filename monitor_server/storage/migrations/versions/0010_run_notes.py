"""free-text notes on each run, written from the dashboard

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-08 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a column added in place (SQLite too): rebuilding `runs` would cascade into the tables that reference it
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("notes", sa.Text(), nullable=False, server_default=""))


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN in place, on SQLite too (3.35 and later), for the same reason
    op.drop_column("runs", "notes")
