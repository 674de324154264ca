"""Two servers starting together on a fresh database: migrations run under a lock (a file lock on SQLite,
an advisory lock on PostgreSQL), so both come up on one schema instead of one dying mid-migration."""

from __future__ import annotations

import sqlite3
import threading

from tests.support.http import loopback
from tests.support.server import API, ServerProcess, run_body


def _start(server: ServerProcess, errors: list[str]) -> None:
    try:
        server.start(timeout=90)
    except RuntimeError as exc:
        errors.append(str(exc)[-2000:])


def test_two_servers_start_together_on_a_fresh_database(db_url, tmp_path):
    for attempt in range(3):  # the race is in the first second: try it a few times
        url = (
            db_url
            if attempt == 0 or not db_url.startswith("sqlite")
            else f"sqlite:///{tmp_path / f'm{attempt}.db'}"
        )
        servers = [ServerProcess(url, log_path=tmp_path / f"s{attempt}-{i}.log") for i in range(2)]
        errors: list[str] = []

        threads = [threading.Thread(target=_start, args=(s, errors)) for s in servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            assert not errors, errors
            rid = loopback.post(f"{servers[0].url}{API}/runs", json=run_body(1)).json()["id"]
            assert loopback.get(f"{servers[1].url}{API}/runs/{rid}").status_code == 200
        finally:
            for s in servers:
                s.stop()
        if not db_url.startswith("sqlite"):
            break  # one fresh schema per test on PostgreSQL


def test_another_process_on_the_sqlite_file_leaves_the_servers_log_alone(tmp_path):
    """The migration lock must not drop the locks SQLite holds on the database file in the server's process
    (closing any descriptor of a file drops all of a process's fcntl locks on it): another process would take
    itself for the file's only user, miss the server's recent writes and checkpoint the log away under it."""
    db = tmp_path / "shared.db"
    with ServerProcess(f"sqlite:///{db}", log_path=tmp_path / "server.log") as server:
        rid = loopback.post(f"{server.url}{API}/runs", json=run_body(1)).json()["id"]
        other = sqlite3.connect(db)
        try:
            assert other.execute("SELECT id FROM runs").fetchall() == [(rid,)]
        finally:
            other.close()
        # the server still has the log open: the other process did not take itself for the last user
        assert db.with_name("shared.db-wal").exists()
        r = loopback.post(f"{server.url}{API}/runs", json=run_body(1))
        assert r.status_code == 201, (r.text, server.log_text())
    with ServerProcess(f"sqlite:///{db}", log_path=tmp_path / "server.log") as server:  # all of it kept
        assert [run["id"] for run in loopback.get(f"{server.url}{API}/runs").json()] == [rid + 1, rid]
