"""The Alembic migrations create exactly the schema the SQLAlchemy models describe, on both backends."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from monitor_server.core.db import make_engine
from monitor_server.migrations import upgrade_to_head
from monitor_server.models import Base


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
