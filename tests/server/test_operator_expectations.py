"""What an operator expects of the service: a database that fails is a JSON 503 and readiness says so while
liveness holds; a NUL in a URL is a 422 on both databases (PostgreSQL would refuse it as a parameter); steps
beyond 2^53 - 1 (which the dashboard cannot tell apart) are refused at ingest."""

from __future__ import annotations

import re

import numpy as np
import pytest
from sqlalchemy import create_engine, make_url, text

from monitor_server.app import create_app
from monitor_server.core.config import Settings
from tests.support.server import (
    API,
    PG_URL,
    batch_body,
    create_run,
    fresh_pg_database,
    random_stats,
    run_body,
)


def test_nul_in_url_is_422(client):
    rid = create_run(client, 1)["id"]
    for url in (f"{API}/runs/{rid}/alerts?kind=over%00flow", f"{API}/runs/{rid}/series?name=lo%00ss"):
        r = client.get(url)
        assert r.status_code == 422, (url, r.text)
        assert r.json()["detail"] == "the URL must not contain NUL characters (%00)"


def test_steps_beyond_2_pow_53_refused(client):
    rid = create_run(client, 1)["id"]
    stats = random_stats(np.random.default_rng(0), 2, 3)
    r = client.post(f"{API}/runs/{rid}/telemetry", json=batch_body("big", [1, 2**53], stats))
    assert r.status_code == 422
    assert r.json()["detail"] == (
        "steps[1].step: 9007199254740992 is above the largest step number, 9007199254740991 (2^53 - 1)"
    )
    assert client.get(f"{API}/runs/{rid}").json()["steps_stored"] == 0
    ok = batch_body("top", [2**53 - 1], {k: v[:1] for k, v in stats.items()})
    assert client.post(f"{API}/runs/{rid}/telemetry", json=ok).status_code == 200
    event = {"kind": "custom", "step": 2**60, "details": {}}
    r = client.post(f"{API}/runs/{rid}/telemetry", json={"idempotency_key": "e", "events": [event]})
    assert r.status_code == 422 and "events[0].step" in r.json()["detail"]


def test_database_failures_are_json_503_and_readiness_follows_writes(pg_database):
    """A PostgreSQL database that turns read-only: reads (and liveness) go on, writes are a JSON 503 with a
    short reason, and /readyz says unavailable until writes work again."""
    from fastapi.testclient import TestClient

    with fresh_pg_database(PG_URL, "fp8scope_ro") as url:
        name = make_url(url).database
        admin = create_engine(make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT")

        def set_read_only(on: bool) -> None:
            with admin.connect() as conn:
                value = "on" if on else "off"
                conn.execute(text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = {value}'))
                # sessions take the setting when they start: end the pooled ones
                conn.execute(
                    text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                    {"n": name},
                )

        try:
            app = create_app(Settings(db_url=url, allowed_hosts=["testserver"]))
            with TestClient(app) as client:
                rid = create_run(client, 1)["id"]
                assert client.get("/readyz").json() == {"status": "ready", "database": "postgresql"}
                set_read_only(True)
                r = client.post(f"{API}/runs", json=run_body(1))
                assert r.status_code == 503 and r.headers["content-type"] == "application/json"
                assert (
                    r.json()["detail"].startswith("database unavailable (")
                    and "retry later" in r.json()["detail"]
                )
                r = client.patch(f"{API}/runs/{rid}", json={"status": "finished"})
                assert r.status_code == 503
                ready = client.get("/readyz")
                assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
                assert client.get("/healthz").status_code == 200  # alive: it answers, reads work
                assert client.get(f"{API}/runs/{rid}").json()["status"] == "running"
                set_read_only(False)
                assert client.get("/readyz").status_code == 200
                assert client.patch(f"{API}/runs/{rid}", json={"status": "finished"}).status_code == 200
        finally:
            set_read_only(False)
            admin.dispose()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_readyz_on_sqlite(client, db_url):
    assert client.get("/readyz").json() == {"status": "ready", "database": "sqlite"}


def _cached(client) -> dict[str, float]:
    lines = client.get("/metrics").text.splitlines()
    rows = [line for line in lines if line.startswith("fp8scope_cached_runs{")]
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in rows}


def test_per_run_caches_are_bounded_and_finished_runs_leave(make_client):
    """A server that sees many runs holds only the `cache_runs` used last, a finished run leaves at once,
    and an evicted run picks up where it was (its detector state comes back from the database)."""
    client = make_client(cache_runs=2)
    stats = random_stats(np.random.default_rng(0), 2, 3)
    rids = [create_run(client, 1, name=f"r{i}")["id"] for i in range(4)]
    for rid in rids:
        assert (
            client.post(f"{API}/runs/{rid}/telemetry", json=batch_body(f"a{rid}", [1, 2], stats)).status_code
            == 200
        )
    assert _cached(client) == {"detectors": 2.0, "meta": 2.0}
    assert client.patch(f"{API}/runs/{rids[-1]}", json={"status": "finished"}).status_code == 200
    assert _cached(client) == {"detectors": 1.0, "meta": 1.0}
    # the first run was evicted long ago: more telemetry, and a non-finite value still raises its alert
    stats["nonfinite"][1, 0] = 3
    assert (
        client.post(f"{API}/runs/{rids[0]}/telemetry", json=batch_body("b", [3, 4], stats)).status_code == 200
    )
    alerts = client.get(f"{API}/runs/{rids[0]}/alerts").json()
    assert [a["kind"] for a in alerts] == ["nonfinite"]
    assert client.get(f"{API}/runs/{rids[0]}").json()["steps_stored"] == 4


def test_alerts_of_a_batch_whose_detector_write_failed_come_with_the_next(make_client, db_url):
    """The batch commits, then storing its alerts fails (here: the database refuses new alerts): the
    batch stays stored, and once the database takes writes again the next batch brings its alert."""
    client = make_client()
    rid = create_run(client, 1)["id"]
    engine = create_engine(db_url)
    sqlite = db_url.startswith("sqlite")
    refuse = (
        "CREATE TRIGGER refuse_alerts BEFORE INSERT ON alerts BEGIN SELECT RAISE(ABORT, 'refused'); END"
        if sqlite
        else "ALTER TABLE alerts ADD CONSTRAINT refuse_alerts CHECK (false) NOT VALID"
    )
    allow = "DROP TRIGGER refuse_alerts" if sqlite else "ALTER TABLE alerts DROP CONSTRAINT refuse_alerts"
    stats = random_stats(np.random.default_rng(0), 2, 3)
    stats["nonfinite"][1, 1] = 7
    try:
        with engine.begin() as conn:
            conn.execute(text(refuse))
        assert (
            client.post(f"{API}/runs/{rid}/telemetry", json=batch_body("bad", [1, 2], stats)).status_code
            == 200
        )
        assert client.get(f"{API}/runs/{rid}/alerts").json() == []
        assert client.get(f"{API}/runs/{rid}").json()["steps_stored"] == 2
        with engine.begin() as conn:
            conn.execute(text(allow))
        calm = random_stats(np.random.default_rng(1), 1, 3)
        assert client.post(f"{API}/runs/{rid}/telemetry", json=batch_body("ok", [3], calm)).status_code == 200
        alerts = client.get(f"{API}/runs/{rid}/alerts").json()
        assert [(a["kind"], a["tensor_index"], a["first_step"]) for a in alerts] == [("nonfinite", 1, 2)]
    finally:
        engine.dispose()


def test_api_docs_have_security_headers_or_are_off(make_client):
    client = make_client()
    for path in ("/docs", "/redoc"):
        r = client.get(path)
        assert r.status_code == 200
        csp = r.headers["content-security-policy"]
        # scripts only from pinned file URLs (never a whole CDN) and the page's own inline script, pinned by
        # its hash; every file loaded from elsewhere carries its Subresource Integrity hash
        script_src = next(d for d in csp.split("; ") if d.startswith("script-src")).split()[1:]
        files = [s for s in script_src if s.startswith("https://")]
        assert files and all(re.search(r"@\d+\.\d+\.\d+/.+\.js$", url) for url in files)
        assert all(s.startswith("'sha256-") for s in script_src if s not in files)
        external = re.findall(r'<(?:script|link)[^>]*(?:src|href)="(https://[^"]+)"([^>]*)>', r.text)
        assert {url for url, _ in external} >= set(files)
        assert all(
            re.search(r'integrity="sha384-[A-Za-z0-9+/]{64}" crossorigin', rest) for _, rest in external
        )
        assert not re.search(r"(src|href) https://[a-z.]+(;| )", csp)  # no host-wide source
        assert "frame-ancestors 'none'" in csp and "connect-src 'self'" in csp
        assert (
            r.headers["x-content-type-options"] == "nosniff" and r.headers["referrer-policy"] == "no-referrer"
        )
        assert "fonts.googleapis.com" not in r.text and "fastapi.tiangolo.com" not in r.text
    off = make_client(api_docs=False)
    assert off.get("/docs").status_code == 404 and off.get("/redoc").status_code == 404
    assert off.get("/openapi.json").status_code == 200
