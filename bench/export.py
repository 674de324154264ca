"""Benchmark: GET /runs/{id}/export of a large run — time, bytes and the server's peak memory.

A run of `--tensors` tensors x `--steps` steps (every step with statistics and a few scalars) is written
into a SQLite database with the service's own storage rows (`monitor_server.storage.rollups.step_stat_rows`;
no rollups, which the export does not read), then every (format, layout) of the statistics table and the
scalars table is downloaded from a fresh `fp8-monitor serve` subprocess. Memory is the server process's
peak resident set (VmHWM in /proc) after the download minus its peak before it (after start-up and exports of
one step in each format and layout, which map pyarrow's writers in), so it is what the export's data
needed at its worst moment. For scale, the whole long
table held at once would be rows x 68 bytes in Arrow (step, three dictionary indices, six float64) and the
CSV text several times that.

    .venv/bin/python bench/export.py                       # 512 tensors x 10,000 steps (5.1 M long rows)
    .venv/bin/python bench/export.py --steps 2000 --out /tmp/e.json

Prints a table and writes bench/results/export.json (Linux only: reads /proc).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from sqlalchemy import insert

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from monitor_server.core.db import Database  # noqa: E402
from monitor_server.storage.models import StepRow, StepStat  # noqa: E402
from monitor_server.storage.stat_rows import step_stat_rows  # noqa: E402
from tests.support.server import API, ServerProcess, random_stats, run_body  # noqa: E402

CASES = (
    ("csv", "stats", "long"),
    ("parquet", "stats", "long"),
    ("csv", "stats", "wide"),
    ("parquet", "stats", "wide"),
    ("parquet", "scalars", None),
)
ARROW_BYTES_PER_LONG_ROW = 8 + 3 * 4 + 6 * 8


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/<pid>/status")


def fill(db_url: str, run_id: int, T: int, steps: int, chunk: int = 500) -> float:
    """Store `steps` steps of statistics (with a NaN and an inf in each chunk) and scalars; seconds taken."""
    db = Database(db_url)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for first in range(0, steps, chunk):
        n = min(chunk, steps - first)
        stats = random_stats(rng, n, T)
        stats["amax"][0, first % T] = np.nan
        stats["amax"][n - 1, (first + 1) % T] = np.inf
        step_ids = np.arange(first, first + n, dtype=np.int64)
        with db.write() as session:
            session.execute(
                insert(StepRow),
                [
                    {"run_id": run_id, "step": s, "loss": 2.0, "scalars": {"loss": 2.0, "lr": 3e-4}}
                    for s in step_ids.tolist()
                ],
            )
            session.execute(insert(StepStat), step_stat_rows(run_id, step_ids, stats))
    db.dispose()
    return time.perf_counter() - t0


def measure(db_url: str, run_id: int, fmt: str, table: str, layout: str | None) -> dict:
    """Download one export from a fresh server; time, bytes and peak-memory growth of the server."""
    with ServerProcess(db_url) as server:
        pid = server.proc.pid
        # warm up: the first export maps pyarrow's writer code into memory (some 50 MB whatever the size)
        for warm in ("csv", "parquet"):
            for shape in ("long", "wide"):
                params = {"format": warm, "layout": shape, "from": 0, "to": 0}
                url = f"{server.url}{API}/runs/{run_id}/export"
                httpx.get(url, params=params, timeout=60).raise_for_status()
        print(f"  server peak RSS after start-up and the warm-up: {peak_rss_mb(pid):.0f} MB", flush=True)
        before = peak_rss_mb(pid)
        params = {"format": fmt, "table": table} | ({"layout": layout} if layout else {})
        t0 = time.perf_counter()
        size = 0
        with httpx.stream("GET", f"{server.url}{API}/runs/{run_id}/export", params=params, timeout=600) as r:
            r.raise_for_status()
            for chunk in r.iter_bytes():
                size += len(chunk)
        seconds = time.perf_counter() - t0
        after = peak_rss_mb(pid)
    return {
        "format": fmt,
        "table": table,
        "layout": layout,
        "seconds": round(seconds, 2),
        "mb": round(size / 2**20, 1),
        "peak_rss_before_mb": round(before, 1),
        "peak_rss_after_mb": round(after, 1),
        "peak_growth_mb": round(after - before, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "export.json")
    parser.add_argument("--cases", default="all", help="'all' or 'long': the long statistics tables only")
    args = parser.parse_args(argv)
    cases = CASES if args.cases == "all" else [c for c in CASES if c[2] == "long"]
    with tempfile.TemporaryDirectory() as tmp:
        db_url = f"sqlite:///{tmp}/export.db"
        with ServerProcess(db_url) as server:  # creates the schema and registers the run
            body = run_body(args.tensors // 3, name="export-bench")
            run_id = (
                httpx.post(f"{server.url}{API}/runs", json=body, timeout=60).raise_for_status().json()["id"]
            )
        T = 3 * (args.tensors // 3)
        fill_s = fill(db_url, run_id, T, args.steps)
        rows = [measure(db_url, run_id, *case) for case in cases]
        db_mb = Path(f"{tmp}/export.db").stat().st_size / 2**20
    long_rows = T * args.steps
    result = {
        "meta": {
            "tensors": T,
            "steps": args.steps,
            "long_rows": long_rows,
            "db_mb": round(db_mb, 1),
            "fill_seconds": round(fill_s, 1),
            "whole_long_table_arrow_mb": round(long_rows * ARROW_BYTES_PER_LONG_ROW / 2**20, 1),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "database": "sqlite",
        },
        "rows": rows,
    }
    print(
        f"{T} tensors x {args.steps} steps ({long_rows:,} long rows); the whole long table in Arrow would "
        f"be {result['meta']['whole_long_table_arrow_mb']} MB"
    )
    print(f"{'format':8} {'table':8} {'layout':6} {'seconds':>8} {'MB out':>8} {'peak RSS growth MB':>19}")
    for r in rows:
        print(
            f"{r['format']:8} {r['table']:8} {r['layout'] or '-':6} {r['seconds']:8.1f} {r['mb']:8.1f} "
            f"{r['peak_growth_mb']:19.1f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
