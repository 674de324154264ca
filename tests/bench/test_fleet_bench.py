"""bench/fleet.py and bench/many_runs.py in small runs: two real instances on one PostgreSQL database with
a few simulated runs (every step stored once, each injected NaN one incident and one webhook message), and
the runs list and periodic passes over a thousand runs (the timings are the full benchmarks' to measure)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text

ROOT = Path(__file__).resolve().parents[2]
PG_URL = os.environ.get("FP8SCOPE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

pytestmark = pytest.mark.slow  # about 40 s: two servers for 12 s, a thousand runs on two databases


@pytest.fixture(scope="module")
def pg_server_url() -> str:
    url = make_url(PG_URL).set(database="postgres")
    try:
        engine = create_engine(url)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as exc:
        if os.environ.get("FP8SCOPE_REQUIRE_PG") == "1":
            pytest.fail(f"PostgreSQL not reachable: {exc} (FP8SCOPE_REQUIRE_PG=1)")
        pytest.skip(f"PostgreSQL not reachable: {exc}")
    return url.render_as_string(hide_password=False)


def _run(script: str, *args: str, pg: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        env={**os.environ, "FP8SCOPE_BENCH_PG_URL": pg},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_fleet_bench_small(tmp_path, pg_server_url):
    out = tmp_path / "fleet.json"
    # a step per second per run; compaction drops whole blocks of 8 steps older than the last 2 kept, so
    # it needs 10 steps of each run: 16 s leaves room for a loaded machine whose sender loop runs late
    # (at 12 s with 4 kept, a run that got 11 steps out had nothing to compact)
    args = ["--runs", "4", "--tensors", "32", "--seconds", "16", "--nan-runs", "2", "--no-kill"]
    _run("fleet.py", *args, "--keep-steps", "2", "--out", str(out), pg=pg_server_url)
    (r,) = json.loads(out.read_text())
    assert r["steps_sent"] == r["steps_stored"] > 0 and r["steps_lost"] == r["steps_twice"] == 0
    assert r["steps_stored"] >= 4 * 10, r  # enough for compaction to drop a block of each run
    assert r["nan_runs"] == 2 and r["incidents"] == 2 and r["nonfinite_alerts"] == 2
    assert r["webhook_messages"] == 2 and r["other_alerts"] == 0
    assert r["local_p50_s"] is not None  # the stream of the instance that took each step saw it
    assert 0 < r["bytes_per_value_compacted"] < r["bytes_per_value"]


def test_many_runs_bench_small(tmp_path, pg_server_url):
    out = tmp_path / "many.json"
    stdout = _run("many_runs.py", "--runs", "1000", "--out", str(out), pg=pg_server_url)
    data = json.loads(out.read_text())
    assert data["runs"] == 1000 and set(data["median_ms"]) == {"sqlite", "postgresql"}
    assert all(len(v) == 7 and all(ms > 0 for ms in v.values()) for v in data["median_ms"].values())
    assert "stall check" in stdout
