"""ids are never reused: AUTOINCREMENT on SQLite for the tables whose ids clients and caches hold

SQLite without AUTOINCREMENT hands the id of a deleted newest row to the next insert: a deleted run's job
would write into the next run registered, a dashboard's alert id would name another alert. PostgreSQL's
sequences never hand out a number twice: nothing to do there.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-09 10:00:00.000000
"""

from __future__ import annotations

import re

from alembic import op
from sqlalchemy import Connection, text

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

#: the tables whose ids leave the database (URLs, a job's run id, a page's alert ids, cached meta)
TABLES = ("runs", "alerts", "events", "commands", "incidents")

_ID_COLUMN = re.compile(r"\bid INTEGER NOT NULL\s*,")
_ID_KEY = re.compile(r",\s*PRIMARY KEY \(id\)")


def autoincrement_sql(table: str, create_sql: str) -> str:
    """The CREATE TABLE statement of `table` as SQLite keeps it, made the statement of ``<table>__new`` with
    ``id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT`` (every other column and constraint as it was)."""
    head = f"CREATE TABLE {table} ("
    if not create_sql.startswith(head):
        raise RuntimeError(f"unexpected schema of {table!r}: {create_sql[:80]!r}")
    sql = f"CREATE TABLE {table}__new (" + create_sql[len(head) :]
    sql, columns = _ID_COLUMN.subn("id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,", sql, count=1)
    sql, keys = _ID_KEY.subn("", sql, count=1)
    if columns != 1 or keys != 1:
        raise RuntimeError(f"unexpected schema of {table!r}: no single integer primary key 'id'")
    return sql


def rebuild_with_autoincrement(conn: Connection, table: str) -> None:
    """SQLite's table rebuild (https://sqlite.org/lang_altertable.html#otheralter): a new table with the
    same columns copied row for row (ids kept, so `sqlite_sequence` starts at the largest), the old one
    dropped, the new one renamed, its indexes created again from their own statements."""
    create_sql = conn.execute(
        text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = :t"), {"t": table}
    ).scalar_one()
    if "AUTOINCREMENT" in create_sql.upper():
        return
    indexes = conn.execute(
        text("SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = :t AND sql IS NOT NULL"),
        {"t": table},
    ).scalars()
    indexes = list(indexes)
    conn.exec_driver_sql(autoincrement_sql(table, create_sql))
    conn.exec_driver_sql(f"INSERT INTO {table}__new SELECT * FROM {table}")
    conn.exec_driver_sql(f"DROP TABLE {table}")
    conn.exec_driver_sql(f"ALTER TABLE {table}__new RENAME TO {table}")
    for sql in indexes:
        conn.exec_driver_sql(sql)


def upgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name != "sqlite":
        return
    # dropping the old `runs` with foreign keys on would delete every row that references it (ON DELETE
    # CASCADE); they can only be switched off outside a transaction, which `upgrade_to_head` does
    if conn.exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise RuntimeError(
            "migration 0011 rebuilds tables and needs SQLite's foreign keys off: "
            "apply it with monitor_server.storage.migrations.upgrade_to_head (fp8-monitor does)"
        )
    for table in TABLES:
        rebuild_with_autoincrement(conn, table)
    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    if broken:
        raise RuntimeError(f"rows whose run is missing after the rebuild: {broken[:5]}")


def downgrade() -> None:
    # AUTOINCREMENT stays: the earlier revisions read and write such tables unchanged, and rebuilding them
    # again would need foreign keys off for nothing gained
    pass
