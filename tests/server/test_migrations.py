"""The Alembic migrations create exactly the schema the SQLAlchemy models describe, on both backends."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import numpy as np
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session

from monitor_server.core.db import make_engine
from monitor_server.storage.block_hist import read_histogram
from monitor_server.storage.migrations import alembic_config, upgrade_to_head
from monitor_server.storage.models import Base


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


def test_block_histogram_sums_migration_sums_the_sealed_blocks_stored_before_it(db_url):
    """Histograms stored before revision 0009 (per step, and compaction's 8-step sums) get the coarse sums
    of the blocks their run had moved past; the answers over them are the per-step sums."""
    rng = np.random.default_rng(5)
    last_step = 1100  # sealed: 17 blocks of 64, 2 of 512, none of 4096
    sent = np.zeros((2, last_step + 1, 256), dtype=np.uint64)
    engine = make_engine(db_url)
    try:
        with at_revision(engine, "0008") as connection:
            insert_run(connection, "running", num_tensors=2, steps_stored=last_step + 1)
            connection.execute(text("UPDATE runs SET last_step = :s"), {"s": last_step})
            rows = []
            for tensor, step in itertools.product((0, 1), range(last_step + 1)):
                if (tensor, step % 5) == (1, 0):
                    continue  # tensor 1 sent no histogram at every fifth step
                lo = int(rng.integers(100, 130))
                counts = rng.integers(1, 1000, int(rng.integers(1, 6)))
                sent[tensor, step, lo : lo + len(counts)] = counts
                rows.append((tensor, 1, step, lo, 1, counts.astype("<u4").tobytes()))
            for tensor, start in itertools.product((0, 1), range(0, 96, 8)):  # steps 0-95 compacted
                block = sent[tensor, start : start + 8].sum(axis=0)
                nz = np.flatnonzero(block)
                n = sum(1 for s in range(start, start + 8) if sent[tensor, s].any())
                rows = [r for r in rows if not (r[0] == tensor and start <= r[2] < start + 8)]
                rows.append(
                    (tensor, 8, start, int(nz[0]), n, block[nz[0] : nz[-1] + 1].astype("<u8").tobytes())
                )
            connection.execute(
                text(
                    "INSERT INTO block_histograms (run_id, tensor, level, step, lo, n_steps, counts) "
                    "VALUES (1, :t, :level, :step, :lo, :n, :counts)"
                ),
                [dict(zip(("t", "level", "step", "lo", "n", "counts"), r, strict=True)) for r in rows],
            )
        upgrade_to_head(engine)
        with engine.connect() as conn:
            levels = dict(
                conn.execute(text("SELECT level, count(*) FROM block_histograms GROUP BY level")).all()
            )
        assert levels[64] == 2 * 17 and levels[512] == 2 * 2 and 4096 not in levels
        with Session(engine) as session:
            for tensor, max_steps in itertools.product((0, 1), (1000, 15, 2, 1)):
                hist = read_histogram(session, 1, tensor, 0, last_step, max_steps)
                assert hist.width % {1000: 8, 15: 64, 2: 512, 1: 512}[max_steps] == 0  # read from that level
                for k, (a, b) in enumerate(zip(hist.starts, hist.ends, strict=True)):
                    want = sent[tensor, a : b + 1].sum(axis=0)
                    got = np.zeros(256, dtype=np.uint64)
                    got[hist.lo : hist.lo + hist.counts.shape[1]] = hist.counts[k]
                    np.testing.assert_array_equal(got, want)
                    assert hist.steps[k] == int(sent[tensor, a : b + 1].any(axis=1).sum())
        cfg = alembic_config()
        with engine.begin() as connection:
            cfg.attributes["connection"] = connection
            command.downgrade(cfg, "0008")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT max(level) FROM block_histograms")).scalar() == 8
    finally:
        engine.dispose()


def test_run_notes_migration_adds_empty_notes_and_goes_back_in_place(db_url):
    """0010 adds `runs.notes` ("" for the runs there were); going back drops it without rebuilding `runs`
    (on SQLite a rebuild would cascade into the tables that reference it)."""
    engine = make_engine(db_url)
    try:
        with at_revision(engine, "0009") as connection:
            insert_run(connection, "finished", num_tensors=1, steps_stored=1)
            connection.execute(text("INSERT INTO tensors VALUES (1, 0, 'fc.input', 'fc', 'input', 'e4m3')"))
        upgrade_to_head(engine)
        with engine.begin() as conn:
            assert conn.execute(text("SELECT name, notes FROM runs")).one() == ("old", "")
            conn.execute(text("UPDATE runs SET notes = 'kept until the downgrade'"))
        cfg = alembic_config()
        with engine.begin() as connection:
            cfg.attributes["connection"] = connection
            command.downgrade(cfg, "0009")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name FROM runs")).scalar() == "old"
            assert conn.execute(text("SELECT count(*) FROM tensors")).scalar() == 1
    finally:
        engine.dispose()


def test_ids_never_reused_migration_keeps_every_row_and_stops_id_reuse(db_url):
    """0011 rebuilds `runs`, `alerts`, `events`, `commands` and `incidents` with AUTOINCREMENT on SQLite
    (PostgreSQL's sequences never reuse already): every row, the rows that reference the runs and the
    partial unique index survive, and the id of a deleted newest row is not handed out again."""
    engine = make_engine(db_url)
    try:
        with at_revision(engine, "0010") as connection:
            insert_run(connection, "finished", num_tensors=1, steps_stored=1)
            insert_run(connection, "running", num_tensors=1, steps_stored=0)
            connection.execute(text("INSERT INTO tensors VALUES (1, 0, 'fc.input', 'fc', 'input', 'e4m3')"))
            connection.execute(
                text("INSERT INTO steps (run_id, step, loss, scalars) VALUES (1, 7, 2.5, '{}')")
            )
            connection.execute(
                text(
                    "INSERT INTO events (run_id, kind, step, details, created_at) "
                    "VALUES (2, 'custom', 3, '{}', CURRENT_TIMESTAMP)"
                )
            )
        upgrade_to_head(engine)
        with engine.begin() as conn:
            assert conn.execute(text("SELECT count(*) FROM tensors")).scalar() == 1
            assert conn.execute(text("SELECT step FROM steps WHERE run_id = 1")).scalar() == 7
            assert conn.execute(text("SELECT id FROM events")).scalar() == 1
            assert conn.execute(text("DELETE FROM runs WHERE id = 2")).rowcount == 1
            assert conn.execute(text("SELECT count(*) FROM events")).scalar() == 0  # cascades still work
            insert_run(conn, "running", num_tensors=1, steps_stored=0)
            assert conn.execute(text("SELECT max(id) FROM runs")).scalar() == 3
            if engine.dialect.name == "sqlite":
                assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
                index = conn.execute(text("SELECT sql FROM sqlite_master WHERE name = 'uq_alerts_open'"))
                assert "WHERE" in index.scalar().upper()
    finally:
        engine.dispose()
