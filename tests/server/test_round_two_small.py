"""Smaller hardening points of issue 38 (items 9, 10, 12, 13): what a caller without a token can learn,
what `fp8-monitor upload` prints, deep filters, secrets, readiness."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import orjson
import pytest

from monitor_server import cli
from monitor_server.core.config import Settings
from tests.support.server import API, batch_body, create_run, quiet_stats, running_server

AUTH = {"tokens": ["job:ingest:ingest-secret", "dash:read:read-secret"]}
READ = {"Authorization": "Bearer read-secret"}
JOB = {"Authorization": "Bearer ingest-secret"}


def _run_paths(client) -> list[str]:
    """Every GET route of the API (its OpenAPI schema) that names a run (other ids in the path: 1)."""
    paths = client.app.openapi()["paths"]
    return [
        path.replace("{incident_id}", "1").replace("{event_id}", "1")
        for path, methods in paths.items()
        if "{run_id}" in path and "get" in methods
    ]


def test_without_the_scope_an_existing_and_a_missing_run_get_the_same_answer(make_client):
    """Item 13: the token and its scope are checked before the run is looked up, on every route that names
    one: a caller without the read scope cannot tell which runs exist."""
    client = make_client(**AUTH)
    run_id = create_run(client, headers=JOB)["id"]
    paths = _run_paths(client)
    assert len(paths) >= 14
    for path in paths:
        for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401), (JOB, 403)):
            existing = client.get(path.replace("{run_id}", str(run_id)), headers=headers)
            missing = client.get(path.replace("{run_id}", "99999"), headers=headers)
            assert (existing.status_code, missing.status_code) == (status, status), (headers, path)
            assert existing.json()["detail"] == missing.json()["detail"]
    assert client.get(f"{API}/runs/99999", headers=READ).status_code == 404
    assert client.get(f"{API}/runs/{run_id}", headers=READ).status_code == 200


def test_upload_prints_no_terminal_escape_sequences_from_the_spool(tmp_path, capsys):
    hostile = "k\x1b]2;owned\x07\x1b[2J\u202e"  # retitle the window, clear the screen, reverse the text
    records = [
        {"type": "run", "version": 1, "client_key": "c1", "body": {"name": "x", "tensors": []}},
        {"type": "batch", "body": {"idempotency_key": hostile, "steps": "not a list"}},
    ]
    spool = tmp_path / "spool.jsonl"
    spool.write_bytes(b"\n".join(orjson.dumps(r) for r in records) + b"\n")
    with running_server(f"sqlite:///{tmp_path / 'm.db'}") as server:
        code = cli.main(["upload", str(spool), "--url", server.url])
    out = capsys.readouterr()
    assert code == 1
    printed = out.out + out.err
    assert "refused: k\\x1b]2;owned\\x07\\x1b[2J\\u202e: HTTP 422" in printed
    assert not any(c in printed for c in "\x1b\x07\u202e")


@pytest.mark.parametrize("value", ["[" * 5000 + "]" * 5000, "[" * 20_000, '{"a":' * 40 + "1" + "}" * 40])
def test_a_deep_config_filter_is_refused_naming_it(client, value):
    """Item 9: a deep `config=` value is a 422 naming the parameter (it was a RecursionError: a plain 500 and
    a reset connection); the list keeps answering."""
    create_run(client, config={"a": 1})
    r = client.get(f"{API}/runs", params={"config": f"a={value}"})
    assert r.status_code == 422, r.text[:200]
    assert "config" in r.json()["detail"]
    assert [run["config"]["a"] for run in client.get(f"{API}/runs", params={"config": "a=1"}).json()] == [1]


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MiB file system (tmpfs) to fill; the test skips, saying why, where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(
            f"a full disk needs a small tmpfs, and mounting one failed here: {made.stderr.decode()[:200]}"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_readyz_is_not_ready_on_a_full_disk_where_ingest_fails(small_disk):
    """Item 12: SQLite on a file system that fills up. Once ingest answers 503 (the disk is full), /readyz
    answers 503 too (it said ready: its probe write was rolled back before it reached the disk)."""
    from fastapi.testclient import TestClient

    from monitor_server.app import create_app
    from monitor_server.core.config import Settings

    db_url = f"sqlite:///{small_disk / 'm.db'}"
    settings = Settings(db_url=db_url, allowed_hosts=["testserver"], max_body_bytes=1024 * 1024)
    with TestClient(create_app(settings)) as client:
        assert client.get("/readyz").status_code == 200
        run_id = create_run(client, n_layers=20)["id"]  # T = 60
        stats = quiet_stats(200, 60)
        noise = np.random.default_rng(0).random((200, 60))  # values that do not compress away
        stats = {name: values + noise for name, values in stats.items()}
        statuses = []
        for first in range(0, 200 * 200, 200):
            body = batch_body(f"k{first}", range(first, first + 200), stats, encoding="float64")
            statuses.append(client.post(f"{API}/runs/{run_id}/telemetry", json=body).status_code)
            if statuses[-1] != 200:
                break
        assert statuses[-1] == 503 and set(statuses[:-1]) == {200}, statuses
        ready = client.get("/readyz")
        assert ready.status_code == 503, ready.text
        assert ready.json()["detail"] in ("DiskFull", "OperationalError")


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "monitor_server.cli", "serve", "--port", "1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


SECRET = "Sup3rSecretValue99"


def test_swapped_token_fields_never_show_the_secret(tmp_path):
    """Item 10: `name:secret:scopes` (fields swapped) is refused without repeating the secret."""
    db = f"sqlite:///{tmp_path}/x.db"
    for args, env in (
        (("--token", f"ops:{SECRET}:read"), {}),
        ((), {"FP8SCOPE_TOKENS": f"ops:{SECRET}:read+control"}),
    ):
        proc = _serve("--db", db, *args, env=env)
        assert proc.returncode == 2 and "scopes must be" in proc.stderr, proc.stderr
        assert SECRET not in proc.stderr + proc.stdout


def test_a_tokens_file_other_users_can_read_is_refused(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"trainer:ingest:{SECRET}\n")
    path.chmod(0o644)
    proc = _serve("--db", f"sqlite:///{tmp_path}/x.db", "--tokens-file", str(path))
    assert proc.returncode == 2, proc.stderr
    assert "mode 0644" in proc.stderr and f"chmod 600 {path}" in proc.stderr
    assert SECRET not in proc.stderr
    path.chmod(0o640)  # a service group may read it
    assert Settings(_env_file=None, tokens_file=str(path)).auth_enabled  # type: ignore[call-arg]


def test_database_and_webhook_urls_from_private_files_not_the_command_line(tmp_path):
    """Item 10: `--db-file` / `--webhook-url-file` (and their FP8SCOPE_*_FILE variables) read the URLs
    from private files; a password given with `--db` is warned about, without repeating it."""
    db_file, hook_file = tmp_path / "db", tmp_path / "hook"
    db_file.write_text(f"sqlite:///{tmp_path}/from-file.db\n")
    hook_file.write_text(f"https://hooks.example.com/{SECRET}\n")
    for path in (db_file, hook_file):
        path.chmod(0o600)
    args = cli.build_parser().parse_args(
        ["serve", "--db-file", str(db_file), "--webhook-url-file", str(hook_file)]
    )
    settings = cli.build_settings(args)
    assert settings.db_url == f"sqlite:///{tmp_path}/from-file.db"
    assert settings.webhook_url == f"https://hooks.example.com/{SECRET}"
    hook_file.chmod(0o604)
    with pytest.raises(ValueError, match="webhook_url_file"):
        cli.build_settings(args)
    flags = cli.build_parser().parse_args(["serve", "--db", f"postgresql://u:{SECRET}@db/x"])
    warnings = cli.secrets_on_command_line(flags)
    assert warnings and "FP8SCOPE_DB_URL" in warnings[0] and SECRET not in " ".join(warnings)
