"""Benchmark: the service with 10,000 runs in its database (a lab's year), on SQLite and PostgreSQL.

Fills the database with N runs (most finished, some running, a few hundred with open alerts, tags on each),
then times what grows with the number of runs: the runs list (first page, a deep page through the cursor,
filtered by status, name and tag) over HTTP from a real `fp8-monitor serve`, and the periodic stall check
and runs maintenance in-process on the same database.

    .venv/bin/python bench/many_runs.py [--runs 10000] [--skip-pg]

Goal: every list request and each periodic pass within 100 ms (median of repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import httpx
from sqlalchemy import insert

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from monitor_server.api.context import AppContext  # noqa: E402
from monitor_server.core.config import Settings  # noqa: E402
from monitor_server.storage.migrations import upgrade_to_head  # noqa: E402
from monitor_server.storage.models import Alert, Run, RunTag, utcnow  # noqa: E402
from tests.support.server import API, fresh_pg_database, running_server  # noqa: E402

PG_URL = os.environ.get("FP8SCOPE_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
GOAL_MS = 100.0
REPEATS = 7


def fill(ctx: AppContext, n: int) -> None:
    """n runs: every 20th running (fresh telemetry), the rest finished; every 25th with an open alert."""
    now = utcnow()
    runs, tags, alerts = [], [], []
    for i in range(n):
        running = i % 20 == 0
        runs.append(
            {
                "name": f"lab-{i:05d}-{'gpt' if i % 3 else 'llama'}",
                "config": {"lr": 3e-4, "seed": i},
                "recipe": {"format": "HYBRID"},
                "recipe_overrides": {},
                "world_size": 8,
                "host": f"node{i % 64}",
                "status": "running" if running else "finished",
                "num_tensors": 512,
                "created_at": now - timedelta(hours=n - i),
                "updated_at": now - timedelta(minutes=1 if running else n - i),
                "last_telemetry_at": now - timedelta(seconds=5) if running else now - timedelta(hours=n - i),
                "first_step": 0,
                "last_step": 1000 + i,
                "steps_stored": 1001 + i,
            }
        )
    with ctx.db.write() as session:
        session.execute(insert(Run), runs)
        ids = [
            r for (r,) in session.execute(Run.__table__.select().with_only_columns(Run.id).order_by(Run.id))
        ]
        for k, run_id in enumerate(ids):
            tags.append({"run_id": run_id, "tag": f"team-{k % 12}"})
            if k % 25 == 0:
                alerts.append(
                    {
                        "run_id": run_id,
                        "kind": "overflow_burst",
                        "severity": "warning",
                        "state": "open",
                        "tensor_index": 3,
                        "tensor_key": 3,
                        "first_step": 10,
                        "last_step": 20,
                        "message": "overflow burst",
                        "evidence": {},
                        "count": 1,
                        "created_at": now,
                        "updated_at": now,
                    }
                )
        session.execute(insert(RunTag), tags)
        session.execute(insert(Alert), alerts)


def median_ms(fn) -> float:
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def measure(db_url: str, n: int, tmp: Path) -> dict[str, float]:
    ctx = AppContext.create(Settings(db_url=db_url))
    upgrade_to_head(ctx.db.engine)
    fill(ctx, n)
    out: dict[str, float] = {}
    with running_server(db_url, log_path=tmp / "server.log") as srv, httpx.Client(base_url=srv.url) as http:

        def get(path: str, **params: object) -> httpx.Response:
            r = http.get(f"{API}{path}", params=params)
            r.raise_for_status()
            return r

        cursor, pages = None, max(1, min(20, n // 200))  # down to the middle of the list (20 pages at most)
        for _ in range(pages):
            params = {"limit": 100} | ({"before": cursor} if cursor else {})
            cursor = get("/runs", **params).headers["x-next-cursor"]
        out["GET /runs (first page of 100)"] = median_ms(lambda: get("/runs", limit=100))
        out[f"GET /runs (page {pages + 1}, through the cursor)"] = median_ms(
            lambda: get("/runs", limit=100, before=cursor)
        )
        out["GET /runs?status=running"] = median_ms(lambda: get("/runs", status="running", limit=100))
        out["GET /runs?q=llama"] = median_ms(lambda: get("/runs", q="llama", limit=100))
        out["GET /runs?tag=team-7"] = median_ms(lambda: get("/runs", tag="team-7", limit=100))
    out["stall check (in-process)"] = median_ms(ctx.detection.check_stalled_runs)
    out["runs maintenance (in-process)"] = median_ms(lambda: ctx.maintain(utcnow()))
    ctx.db.dispose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--skip-pg", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "many_runs.json")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["sqlite"] = measure(f"sqlite:///{Path(tmp) / 'many.db'}", args.runs, Path(tmp))
        if not args.skip_pg:
            with fresh_pg_database(PG_URL, "many") as url:
                results["postgresql"] = measure(url, args.runs, Path(tmp))
    print(f"| {args.runs} runs | " + " | ".join(results) + " | goal |")
    print("|---|" + "---|" * len(results) + "---|")
    for what in next(iter(results.values())):
        cells = " | ".join(f"{r[what]:.1f} ms" for r in results.values())
        ok = all(r[what] <= GOAL_MS for r in results.values())
        print(f"| {what} | {cells} | {'ok' if ok else 'MISS'} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": args.runs, "median_ms": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
