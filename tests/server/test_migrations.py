"""The Alembic migrations create exactly the schema the SQLAlchemy models describe, on both backends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, Engine, text

from monitor_server.core.db import make_engine
from monitor_server.migrations import alembic_config, upgrade_to_head
from monitor_server.models import Base


@contextlib.contextmanager
def at_revision(engine: Engine, revision: str) -> Iterator[Connection]:
    """The database migrated up to `revision` only; yields the migration's transaction, to insert rows of
    that schema in."""
    cfg = alembic_config()
    with engine.begin() as connection:
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)
        yield connection


def insert_run(connection: Connection, status: str, num_tensors: int, steps_stored: int) -> None:
    """Run 1, named 'old', with the columns `runs` has had since the first revision."""
    connection.execute(
        text(
            "INSERT INTO runs (name, config, recipe, recipe_overrides, world_size, host, status, "
            "num_tensors, created_at, updated_at, steps_stored) VALUES ('old', '{}', '{}', '{}', 1, '', "
            ":status, :num_tensors, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, :steps_stored)"
        ),
        {"status": status, "num_tensors": num_tensors, "steps_stored": steps_stored},
    )


def test_migrations_match_models_and_are_idempotent(db_url):
    engine = make_engine(db_url)
    try:
        upgrade_to_head(engine)
        upgrade_to_head(engine)  # a second start finds nothing to do
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(context, Base.metadata)
        assert diff == []
    finally:
        engine.dispose()


def test_incidents_migration_keeps_existing_alerts_and_the_partial_index(db_url):
    engine = make_engine(db_url)
    try:
        with at_revision(engine, "0002") as connection:
            insert_run(connection, "running", num_tensors=3, steps_stored=0)
            connection.execute(
                text(
                    "INSERT INTO alerts (run_id, kind, tensor_index, tensor_key, state, severity, message, "
                    "first_step, last_step, count, evidence, created_at, updated_at) VALUES (1, 'nonfinite', "
                    "0, 0, 'open', 'critical', 'old alert', 5, 5, 1, '{}', CURRENT_TIMESTAMP, "
                    "CURRENT_TIMESTAMP)"
                )
            )
        upgrade_to_head(engine)
        with engine.connect() as conn:
            row = conn.execute(text("SELECT message, incident_id, onset_step FROM alerts")).one()
            assert tuple(row) == ("old alert", None, None)
            if engine.dialect.name == "sqlite":
                index = conn.execute(
                    text("SELECT sql FROM sqlite_master WHERE name = 'uq_alerts_open'")
                ).scalar()
            else:
                index = conn.execute(
                    text("SELECT indexdef FROM pg_indexes WHERE indexname = 'uq_alerts_open'")
                ).scalar()
            assert "UNIQUE" in index.upper() and "WHERE" in index.upper()
    finally:
        engine.dispose()


def test_run_tags_migration_keeps_runs_and_everything_that_hangs_off_them(db_url):
    """0006 adds a column to `runs`: on SQLite that must not rebuild the table (dropping it would cascade
    into every table that references it)."""
    engine = make_engine(db_url)
    try:
        with at_revision(engine, "0005") as connection:
            insert_run(connection, "finished", num_tensors=1, steps_stored=1)
            connection.execute(text("INSERT INTO tensors VALUES (1, 0, 'fc.input', 'fc', 'input', 'e4m3')"))
            connection.execute(
                text("INSERT INTO steps (run_id, step, loss, scalars) VALUES (1, 7, 2.5, '{}')")
            )
        upgrade_to_head(engine)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name, status, scalar_names FROM runs")).one() == (
                "old",
                "finished",
                None,
            )
            assert conn.execute(text("SELECT count(*) FROM tensors")).scalar() == 1
            assert conn.execute(text("SELECT step FROM steps")).scalar() == 7
            assert conn.execute(text("SELECT count(*) FROM run_tags")).scalar() == 0
    finally:
        engine.dispose()


def test_block_histograms_migration_adds_its_table_to_a_populated_database(db_url):
    engine = make_engine(db_url)
    try:
        with at_revision(engine, "0007") as connection:
            insert_run(connection, "running", num_tensors=2, steps_stored=0)
        upgrade_to_head(engine)
        with engine.begin() as conn:
            assert conn.execute(text("SELECT name FROM runs")).scalar() == "old"
            conn.execute(
                text(
                    "INSERT INTO block_histograms (run_id, tensor, level, step, lo, n_steps, counts) "
                    "VALUES (1, 0, 1, 5, 120, 1, :counts)"
                ),
                {"counts": b"\x01\x00\x00\x00"},
            )
        with engine.begin() as conn:  # the run's histograms go with it
            conn.execute(text("DELETE FROM runs WHERE id = 1"))
            assert conn.execute(text("SELECT count(*) FROM block_histograms")).scalar() == 0
        cfg = alembic_config()
        with engine.begin() as connection:
            cfg.attributes["connection"] = connection
            command.downgrade(cfg, "0007")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == 0  # the rest is untouched
    finally:
        engine.dispose()
