#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: lint, then pytest on two workers. Extra arguments go to
# pytest.
# PostgreSQL-backed tests use FP8SCOPE_TEST_PG_URL (default: the local server at 127.0.0.1:5432, database
# "test"); set FP8SCOPE_REQUIRE_PG=1 to make a missing server a failure instead of a skip (CI does).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

# start the local PostgreSQL cluster if it is installed but down
if command -v pg_ctlcluster >/dev/null 2>&1 && ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
fi

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # the files and strictness of pyproject.toml's [tool.mypy]
# two workers (pytest-xdist), a test module on one worker so that its module fixtures are built once, the
# modules in collection order (the interpreter runs' readers last: tests/conftest.py); set
# FP8SCOPE_TEST_WORKERS=0 for one process (a debugger, say)
exec .venv/bin/python -m pytest -n "${FP8SCOPE_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder "$@"
