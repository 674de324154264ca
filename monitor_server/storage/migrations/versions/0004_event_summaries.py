"""events: a light summary and the size of each event's details, so lists never load the details

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 10:00:00.000000
"""

from __future__ import annotations

import orjson
import sqlalchemy as sa
from alembic import op

from monitor_server.infra.wire import details_summary

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_BATCH = 200


def upgrade() -> None:
    op.add_column("events", sa.Column("summary", sa.JSON(), nullable=True))
    op.add_column("events", sa.Column("details_bytes", sa.Integer(), nullable=True))
    events = sa.table(
        "events",
        sa.column("id", sa.Integer()),
        sa.column("details", sa.JSON()),
        sa.column("summary", sa.JSON()),
        sa.column("details_bytes", sa.Integer()),
    )
    conn = op.get_bind()
    last = 0
    while True:  # the events stored before: a few at a time, whatever their size
        rows = conn.execute(
            sa.select(events.c.id, events.c.details)
            .where(events.c.id > last)
            .order_by(events.c.id)
            .limit(_BATCH)
        ).all()
        if not rows:
            break
        for event_id, details in rows:
            details = details if isinstance(details, dict) else {}
            conn.execute(
                events.update()
                .where(events.c.id == event_id)
                .values(summary=details_summary(details), details_bytes=len(orjson.dumps(details)))
            )
        last = rows[-1][0]


def downgrade() -> None:
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_column("details_bytes")
        batch_op.drop_column("summary")
