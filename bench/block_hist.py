"""What the block scale exponent histograms cost the service: ingest with the block columns and a histogram
per block-scaled tensor and step against the block columns alone (the same steps, packed float64 columns,
through the real app in process on SQLite), and `GET /runs/{id}/block-histogram` of one tensor over the
whole run at two widths; then the long run: a run of 100,000 steps filled through the ingest storage code
(`monitor_server.services.ingest.store_batch`, under the run's lock, in large batches, as bench/ingest.py
fills its heatmap run) on SQLite and PostgreSQL, and the histogram of one tensor over all of it at
max_steps=1000, against the same buckets summed from every per-step row (how it was read before the coarse
sums).

    python bench/block_hist.py                 # 32 layers (96 tensors, 64 block-scaled), 2,000 steps
    python bench/block_hist.py --steps 500     # quicker
    python bench/block_hist.py --long-steps 0  # without the long run
    python bench/block_hist.py --backends sqlite

Ingest is timed as the client sees it (its JSON encoding included), interleaved, best of two runs each.
Prints a table (ms per step ingested, ms per answer) and writes bench/results/block_hist.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastapi.testclient import TestClient  # noqa: E402
from sqlalchemy import select  # noqa: E402

from fp8_protocol.stats import BASE_COLUMNS, BLOCK_COLUMNS, BLOCK_HIST_BINS, FP8_MAX  # noqa: E402
from monitor_server.app import create_app  # noqa: E402
from monitor_server.core.config import Settings  # noqa: E402
from monitor_server.services.ingest import DecodedBatch, store_batch  # noqa: E402
from monitor_server.storage.block_hist import HistEntry, unpack_counts  # noqa: E402
from monitor_server.storage.models import BlockHistogram  # noqa: E402
from monitor_server.storage.rollups import COMPACT_BLOCK  # noqa: E402
from tests.support.server import API, col, fresh_pg_database, random_stats, run_body  # noqa: E402

BATCH = 50
PG_URL = os.environ.get("FP8SCOPE_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def steps_of(rng: np.random.Generator, first: int, n: int, tensors: int, hist: bool) -> list[dict]:
    """`n` steps of base and block columns; with `hist`, a histogram over 4..8 exponents for each
    block-scaled tensor (the first two of every three)."""
    stats = block_columns(rng, n, tensors)
    scaled = np.arange(tensors) % 3 != 2
    out = []
    for i in range(n):
        step = {
            "step": first + i,
            "scalars": {"loss": 2.0},
            "stats": {c: col(stats[c][i], "float64") for c in (*BASE_COLUMNS, *BLOCK_COLUMNS)},
        }
        if hist:
            entries = []
            for t in np.flatnonzero(scaled).tolist():
                width = int(rng.integers(4, 9))
                counts = rng.multinomial(4096 - width, np.ones(width) / width) + 1
                entries.append([t, int(rng.integers(110, 125)), counts.tolist()])
            step["block_hist"] = entries
        out.append(step)
    return out


def ingest(client: TestClient, layers: int, steps: int, hist: bool, seed: int) -> tuple[int, float]:
    """(run id, seconds spent in the telemetry posts)."""
    run = client.post(f"{API}/runs", json=run_body(layers)).json()
    rng = np.random.default_rng(seed)
    spent = 0.0
    for first in range(0, steps, BATCH):
        body = {"idempotency_key": f"b{first}", "steps": steps_of(rng, first, BATCH, 3 * layers, hist)}
        t0 = time.perf_counter()
        r = client.post(f"{API}/runs/{run['id']}/telemetry", json=body)
        spent += time.perf_counter() - t0
        assert r.status_code == 200, r.text
    return run["id"], spent


def block_columns(rng: np.random.Generator, n: int, tensors: int) -> dict[str, np.ndarray]:
    """Base and block columns of `n` steps, the first two tensors of every three block-scaled."""
    scaled = np.arange(tensors) % 3 != 2
    return random_stats(rng, n, tensors) | {
        "blocks": np.where(scaled, 4096.0, 0.0) * np.ones((n, 1)),
        "blocks_at_limit": np.zeros((n, tensors)),
        "blocks_overflow": rng.integers(0, 3, (n, tensors)) * scaled,
        "blocks_underflow": rng.integers(0, 40, (n, tensors)) * scaled,
        "block_range": rng.uniform(3, 12, (n, tensors)) * scaled,
        "blocks_zero": rng.integers(0, 100, (n, tensors)) * scaled,
    }


def fill_long_run(client: TestClient, layers: int, total_steps: int, chunk: int = 2000) -> tuple[int, float]:
    """A run of `total_steps` steps with a histogram (6 exponents) per block-scaled tensor and step, stored
    through `store_batch` (the ingest storage code) under the run's lock; (run id, seconds)."""
    body = run_body(layers, name="bench-long")
    run = client.post(f"{API}/runs", json=body).json()
    db = client.app.state.ctx.db
    T = 3 * layers
    fp8_max = np.array([FP8_MAX[t["format"]] for t in body["tensors"]])
    scaled = np.flatnonzero(np.arange(T) % 3 != 2).tolist()
    rng = np.random.default_rng(2)
    t0 = time.perf_counter()
    for first in range(0, total_steps, chunk):
        n = min(chunk, total_steps - first)
        counts = rng.integers(1, 700, (n, len(scaled), 6)).astype("<u4")
        los = rng.integers(110, 125, (n, len(scaled)))
        hists = {
            first + i: [HistEntry(t, int(los[i, k]), counts[i, k].tobytes()) for k, t in enumerate(scaled)]
            for i in range(n)
        }
        batch = DecodedBatch(
            idempotency_key=f"long-{first}",
            steps=np.arange(first, first + n, dtype=np.int64),
            scalars=[{"loss": 2.0} for _ in range(n)],
            stats=block_columns(rng, n, T),
            block_hist=hists,
        )
        with db.run_lock(run["id"]), db.write() as session:
            store_batch(session, run["id"], batch, fp8_max)
    return run["id"], time.perf_counter() - t0


def per_step_sums(client: TestClient, run_id: int, tensor: int, answer: dict) -> tuple[np.ndarray, float]:
    """The answer's buckets summed from every per-step (and 8-step) row of the tensor, as the service read
    them before the coarse sums: ((buckets, 256) counts, seconds)."""
    t0 = time.perf_counter()
    with client.app.state.ctx.db.read_session() as session:
        rows = session.execute(
            select(BlockHistogram.level, BlockHistogram.step, BlockHistogram.lo, BlockHistogram.counts).where(
                BlockHistogram.run_id == run_id,
                BlockHistogram.tensor == tensor,
                BlockHistogram.level.in_((1, COMPACT_BLOCK)),
                BlockHistogram.step.between(answer["from"], answer["to"]),
            )
        ).all()
    width = answer["bucket_width"]
    first = answer["from"] // width
    out = np.zeros((answer["to"] // width - first + 1, BLOCK_HIST_BINS), dtype=np.uint64)
    for r in rows:
        c = unpack_counts(r.counts, r.level)
        out[r.step // width - first, r.lo : r.lo + len(c)] += c
    return out[out.any(axis=1)], time.perf_counter() - t0


def bench_long_run(db_url: str, layers: int, total_steps: int, repeats: int) -> dict:
    app = create_app(Settings(db_url=db_url, allowed_hosts=["testserver"]))
    with TestClient(app) as client:
        rid, fill_s = fill_long_run(client, layers, total_steps)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            r = client.get(f"{API}/runs/{rid}/block-histogram", params={"tensor": 0, "max_steps": 1000})
            dt = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            if i:  # the first warms the caches
                times.append(dt)
        answer = r.json()
        dense = np.zeros((len(answer["counts"]), BLOCK_HIST_BINS), dtype=np.uint64)
        dense[:, answer["exponent_lo"] : answer["exponent_hi"] + 1] = np.array(answer["counts"], np.uint64)
        per_step = [per_step_sums(client, rid, 0, answer) for _ in range(3)]
        identical = bool(np.array_equal(per_step[0][0], dense))
        assert identical, "the coarse sums' answer differs from the per-step sums"
    return {
        "steps": total_steps,
        "tensors": 3 * layers,
        "fill_seconds": fill_s,
        "buckets": len(answer["bucket_start"]),
        "bucket_width": answer["bucket_width"],
        "read_median_ms": 1e3 * statistics.median(times),
        "read_min_ms": 1e3 * min(times),
        "per_step_sum_ms": 1e3 * min(t for _, t in per_step),
        "identical_to_per_step_sums": identical,
    }


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--long-steps", type=int, default=100_000, help="steps of the long run (0: none)")
    parser.add_argument("--long-layers", type=int, default=4, help="layers of the long run (3 tensors each)")
    parser.add_argument("--backends", default="sqlite,postgresql", help="of the long run: sqlite,postgresql")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(Settings(db_url=f"sqlite:///{tmp}/bench.db", allowed_hosts=["testserver"]))
        with TestClient(app) as client:
            # interleaved, best of two runs each (a shared machine's noise falls on both)
            without = with_hist = float("inf")
            for _ in range(2):
                without = min(without, ingest(client, args.layers, args.steps, hist=False, seed=1)[1])
                rid, spent = ingest(client, args.layers, args.steps, hist=True, seed=1)
                with_hist = min(with_hist, spent)
            reads = {}
            for max_steps in (1000, 100):

                def read(max_steps=max_steps) -> None:
                    r = client.get(
                        f"{API}/runs/{rid}/block-histogram", params={"tensor": 0, "max_steps": max_steps}
                    )
                    assert r.status_code == 200 and r.json()["counts"]

                reads[max_steps] = best_of(read, args.repeats)
    T = 3 * args.layers
    results = {
        "tensors": T,
        "block_scaled": int(np.sum(np.arange(T) % 3 != 2)),
        "steps": args.steps,
        "ingest_ms_per_step_block_columns": 1e3 * without / args.steps,
        "ingest_ms_per_step_with_histograms": 1e3 * with_hist / args.steps,
        "read_ms_max_steps_1000": 1e3 * reads[1000],
        "read_ms_max_steps_100": 1e3 * reads[100],
    }
    print(f"{T} tensors ({results['block_scaled']} block-scaled), {args.steps} steps, batches of {BATCH}")
    print(f"{'what':<48}{'ms':>10}")
    print(f"{'ingest per step, block columns only':<48}{results['ingest_ms_per_step_block_columns']:>10.2f}")
    print(f"{'ingest per step, with histograms':<48}{results['ingest_ms_per_step_with_histograms']:>10.2f}")
    print(
        f"{'GET block-histogram, one tensor, max_steps 1000':<48}{results['read_ms_max_steps_1000']:>10.1f}"
    )
    print(f"{'GET block-histogram, one tensor, max_steps 100':<48}{results['read_ms_max_steps_100']:>10.1f}")
    if args.long_steps:
        results["long_run"] = {}
        print(f"long run: {3 * args.long_layers} tensors x {args.long_steps:,} steps, filled via store_batch")
        print(f"{'backend':<12}{'fill s':>9}{'GET ms (median)':>17}{'per-step sums ms':>18}{'identical':>11}")
        with tempfile.TemporaryDirectory() as tmp:
            for backend in args.backends.split(","):
                ctx = (
                    fresh_pg_database(PG_URL, "fp8scope_bench")
                    if backend == "postgresql"
                    else contextlib.nullcontext(f"sqlite:///{tmp}/long.db")
                )
                with ctx as db_url:
                    r = bench_long_run(db_url, args.long_layers, args.long_steps, 2 * args.repeats - 1)
                results["long_run"][backend] = r
                print(
                    f"{backend:<12}{r['fill_seconds']:>9.1f}{r['read_median_ms']:>17.1f}"
                    f"{r['per_step_sum_ms']:>18.1f}{str(r['identical_to_per_step_sums']):>11}",
                    flush=True,
                )
        results["load_average"] = os.getloadavg()
        print(f"load average (1, 5, 15 min): {results['load_average']}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "block_hist.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
