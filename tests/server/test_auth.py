"""Bearer tokens and scopes: 401 without or with an unknown token, 403 without the scope."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from pydantic import ValidationError

from monitor_server.core.config import Settings, parse_token
from tests.support.server import API, batch_body, random_stats, run_body

TOKENS = [
    "trainer:ingest:trainer-secret-1",
    "dash:read:dash-secret-1",
    "ops:read+control:ops-secret-1",
]


def _h(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_scopes(make_client):
    client = make_client(tokens=TOKENS)
    trainer, dash, ops = _h("trainer-secret-1"), _h("dash-secret-1"), _h("ops-secret-1")
    assert client.get(f"{API}/runs").status_code == 401
    r = client.get(f"{API}/runs", headers=_h("wrong-secret"))
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert client.get(f"{API}/runs", headers={"Authorization": "Basic dXNlcjpwdw=="}).status_code == 401

    r = client.post(f"{API}/runs", json=run_body(1), headers=dash)
    assert r.status_code == 403 and "lacks the scope" in r.json()["detail"]
    r = client.post(f"{API}/runs", json=run_body(1), headers=trainer)
    assert r.status_code == 201
    rid = r.json()["id"]
    stats = random_stats(np.random.default_rng(0), 2, 3)
    assert (
        client.post(
            f"{API}/runs/{rid}/telemetry", json=batch_body("k", [0, 1], stats), headers=dash
        ).status_code
        == 403
    )
    assert (
        client.post(
            f"{API}/runs/{rid}/telemetry", json=batch_body("k", [0, 1], stats), headers=trainer
        ).status_code
        == 200
    )
    assert client.get(f"{API}/runs/{rid}", headers=trainer).status_code == 403
    assert client.get(f"{API}/runs/{rid}", headers=dash).status_code == 200
    assert client.get(f"{API}/runs/{rid}/heatmap", headers=dash).status_code == 200
    assert client.get("/metrics", headers=dash).status_code == 200
    assert client.get("/metrics").status_code == 401

    change = {"target": "model", "changes": {"margin": 1}}
    assert client.post(f"{API}/runs/{rid}/commands", json=change, headers=dash).status_code == 403
    r = client.post(f"{API}/runs/{rid}/commands", json=change, headers=ops)
    assert r.status_code == 201 and r.json()["created_by"] == "ops"
    # a remediation policy's proposal: read to list, control to apply (before any lookup: 403 not 404)
    assert client.get(f"{API}/runs/{rid}/policy-actions", headers=dash).status_code == 200
    assert client.get(f"{API}/runs/{rid}/policy-actions", headers=trainer).status_code == 403
    assert client.post(f"{API}/runs/{rid}/policy-actions/1/apply", headers=dash).status_code == 403
    assert client.post(f"{API}/runs/{rid}/policy-actions/1/apply", headers=ops).status_code == 404
    assert client.get("/healthz").status_code == 200  # liveness stays open
    assert client.get("/openapi.json").status_code == 200


def test_token_parsing():
    t = parse_token("ci:ingest+read:s3cret:with:colons")
    assert t.name == "ci" and t.scopes == {"ingest", "read"} and t.secret == "s3cret:with:colons"
    for bad in ("nocolons", "x:admin:secret-123", "x::secret-123", "x:read:short"):
        with pytest.raises(ValueError):
            parse_token(bad)
    with pytest.raises(ValidationError):
        Settings(tokens=["a:read:secret-123", "a:ingest:secret-456"])
    s = Settings(_env_file=None, tokens="a:read:secret-123,b:ingest:secret-456")  # type: ignore[call-arg]
    assert [t.name for t in s.parsed_tokens] == ["a", "b"]


def test_env_tokens(monkeypatch):
    monkeypatch.setenv("FP8SCOPE_TOKENS", "a:read:secret-123,b:ingest+control:secret-456")
    monkeypatch.setenv("FP8SCOPE_DETECTORS", '{"loss_z_threshold": 4.5}')
    s = Settings()
    assert [t.scopes for t in s.parsed_tokens] == [{"read"}, {"ingest", "control"}]
    assert s.detectors == {"loss_z_threshold": 4.5}


def test_serve_refuses_public_host_without_tokens(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "monitor_server.cli",
        "serve",
        "--host",
        "0.0.0.0",
        "--db",
        f"sqlite:///{tmp_path}/x.db",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "refusing to listen on 0.0.0.0 without tokens" in proc.stderr


def _serve(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "monitor_server.cli", "serve", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def test_token_errors_never_show_a_secret(tmp_path):
    """Malformed entries, from flags, the environment or a file: the error names the entry, never its
    text (an entry that does not split may be a bare secret)."""
    db = f"sqlite:///{tmp_path}/x.db"
    cases = [
        (("--token", "Sup3rSecretValue99"), {}),
        (("--token", "ops:read+control:Sup3rSecretValue99", "--token", "dash:read:Sup3rSecretValue99"), {}),
        ((), {"FP8SCOPE_TOKENS": "ops:root:Sup3rSecretValue99"}),
        ((), {"FP8SCOPE_TOKENS": "ops:read:Sup3rSecretValue99,Sup3rSecretValue99"}),
    ]
    for args, env in cases:
        proc = _serve("--db", db, *args, env=env)
        assert proc.returncode == 2, proc.stderr
        assert "invalid configuration" in proc.stderr
        assert "Sup3rSecretValue99" not in proc.stderr + proc.stdout, proc.stderr
    proc = _serve(
        "--db", db, "--token", "ops:read:Sup3rSecretValue99", "--token", "dash:read:Sup3rSecretValue99"
    )
    assert "tokens 'ops' and 'dash' share one secret" in proc.stderr


def test_tokens_from_a_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# name:scopes:secret\ntrainer:ingest:file-secret-1\n\ndash:read:file-secret-2\n")
    path.chmod(0o600)  # a file of secrets readable by other users is refused
    s = Settings(_env_file=None, tokens_file=str(path))  # type: ignore[call-arg]
    assert [(t.name, t.secret) for t in s.parsed_tokens] == [
        ("trainer", "file-secret-1"),
        ("dash", "file-secret-2"),
    ]
    assert s.auth_enabled
    path.write_text("trainer:ingest:file-secret-1\nbroken-line-with-Sup3rSecretValue99\n")
    proc = _serve("--db", f"sqlite:///{tmp_path}/x.db", "--tokens-file", str(path))
    assert proc.returncode == 2 and f"{path} line 2: expected 'name:scope1+scope2:secret'" in proc.stderr
    assert "Sup3rSecretValue99" not in proc.stderr


def test_ingest_token_writes_only_to_its_own_runs(make_client):
    """Two training jobs with their own ingest tokens: neither can post telemetry (acks included) or set
    the status of the other's run; an operator with `control` can act on any run."""
    client = make_client(tokens=[*TOKENS, "other:ingest:other-secret-1"])
    trainer, other, ops = _h("trainer-secret-1"), _h("other-secret-1"), _h("ops-secret-1")
    rid = client.post(f"{API}/runs", json=run_body(1), headers=trainer).json()["id"]
    cmd = client.post(f"{API}/runs/{rid}/commands", json={"changes": {"margin": 1}}, headers=ops).json()
    stats = random_stats(np.random.default_rng(0), 1, 3)
    ack = batch_body("a", [1], stats, acks=[{"command_id": cmd["id"], "state": "applied", "step": 1}])
    r = client.post(f"{API}/runs/{rid}/telemetry", json=ack, headers=other)
    assert r.status_code == 403 and "registered by another token" in r.json()["detail"]
    r = client.patch(f"{API}/runs/{rid}", json={"status": "finished"}, headers=other)
    assert r.status_code == 403
    run = client.get(f"{API}/runs/{rid}", headers=ops).json()
    assert run["status"] == "running" and run["steps_stored"] == 0
    assert client.get(f"{API}/runs/{rid}/commands", headers=ops).json()[0]["state"] == "pending"
    assert client.post(f"{API}/runs/{rid}/telemetry", json=ack, headers=trainer).status_code == 200
    assert client.patch(f"{API}/runs/{rid}", json={"status": "crashed"}, headers=ops).status_code == 200


def test_the_owner_is_checked_again_on_the_run_the_database_holds(make_client, db_url):
    """The owner check that admits a batch before its body is read takes the run's cached meta without a
    database read; once the body is parsed, the meta checked against the database decides. A database
    restored under the server (the id now another token's run, created at another time) refuses the cached
    owner's batch, and nothing is stored."""
    from sqlalchemy import create_engine, text

    client = make_client(tokens=[*TOKENS, "other:ingest:other-secret-1"])
    trainer = _h("trainer-secret-1")
    rid = client.post(f"{API}/runs", json=run_body(1), headers=trainer).json()["id"]
    stats = random_stats(np.random.default_rng(0), 1, 3)
    assert (
        client.post(
            f"{API}/runs/{rid}/telemetry", json=batch_body("a", [1], stats), headers=trainer
        ).status_code
        == 200
    )
    engine = create_engine(db_url)
    with engine.begin() as conn:  # the row under the id is now another token's run
        conn.execute(
            text(
                "UPDATE runs SET owner = 'other', created_at = created_at + interval '1 hour' WHERE id = :id"
            )
            if engine.dialect.name == "postgresql"
            else text(
                "UPDATE runs SET owner = 'other', created_at = datetime(created_at, '+1 hour') WHERE id = :id"
            ),
            {"id": rid},
        )
    engine.dispose()
    r = client.post(f"{API}/runs/{rid}/telemetry", json=batch_body("b", [2], stats), headers=trainer)
    assert r.status_code == 403 and "registered by another token" in r.json()["detail"]
    ops = _h("ops-secret-1")
    assert client.get(f"{API}/runs/{rid}", headers=ops).json()["steps_stored"] == 1
    r = client.post(
        f"{API}/runs/{rid}/telemetry", json=batch_body("c", [3], stats), headers=_h("other-secret-1")
    )
    assert r.status_code == 200
