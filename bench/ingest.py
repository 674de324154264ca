"""Benchmark: telemetry ingest throughput over HTTP and heatmap latency, on SQLite and PostgreSQL.

One value = one number for one tensor at one step. The stream is 512 tensors x 6 statistics x 50 steps per
batch, posted to a real `fp8-monitor serve` (uvicorn subprocess) with the packed column encoding
(base64 float32 amax/scale, float64 counts) and with plain JSON arrays. Heatmap latency is the median of
several GET /heatmap?max_cols=1000 over a run of 512 tensors x 100,000 steps, filled through the same storage
code as ingest (`monitor_server.services.ingest.store_batch`) in large batches.

    .venv/bin/python bench/ingest.py [--batches 40] [--heatmap-steps 100000] [--skip-pg] [--quality]

With --quality the run also posts the quantization-quality columns (sum_sq, err_sq, subnormal, min_abs:
10 columns a step instead of 6) in the packed encoding ("packed+quality", compared per step with "packed" in
the same run), fills the heatmap run with them and times the SQNR heatmap beside the amax one.

Prints a table and writes bench/results/ingest.json. Goals on a 2-core machine: >= 1,000,000 values/s into
SQLite, heatmap <= 150 ms median.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import doc_parser, machine_info, shown_path, write_json  # noqa: E402
from fp8_protocol.stats import BASE_COLUMNS, FP8_MAX, QUALITY_COLUMNS  # noqa: E402
from monitor_server.core.db import Database  # noqa: E402
from monitor_server.services.ingest import DecodedBatch, store_batch  # noqa: E402
from tests.support.server import col, fresh_pg_database, running_server  # noqa: E402  (shared with the tests)

STATS = BASE_COLUMNS  # the six every run sends; the quality columns are added with --quality
PG_URL = os.environ.get("FP8SCOPE_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def tensors_for(n: int) -> list[dict]:
    """n tensors as the runtime registers them: layer k owns 3k (input), 3k+1 (weight), 3k+2 (grad)."""
    roles = (("input", "e4m3"), ("weight", "e4m3"), ("grad_output", "e5m2"))
    return [
        {
            "index": i,
            "name": f"layers.{i // 3}.{roles[i % 3][0]}",
            "layer": f"layers.{i // 3}",
            "role": roles[i % 3][0],
            "format": roles[i % 3][1],
        }
        for i in range(n)
    ]


class StatStream:
    """Plausible, slowly drifting statistics (quiet for the detectors, like a healthy run)."""

    def __init__(self, T: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.base = np.exp(self.rng.normal(0.0, 2.0, T))
        self.scale = 2.0 ** np.floor(np.log2(448.0 / (self.base * 1.1)))
        self.T = T

    def steps(self, n: int, quality: bool = False) -> dict[str, np.ndarray]:
        """Statistics of n steps, each (n, T); with `quality` the quality columns too (SQNR about 30 dB)."""
        amax = self.base * (1.0 + 0.01 * self.rng.random((n, self.T)))
        if quality:
            numel = float(1 << 20)
            sum_sq = (amax / 20.0) ** 2 * numel
            sqnr = 30.0 + self.rng.normal(0.0, 1.0, (n, self.T))
            extra = {
                "sum_sq": sum_sq,
                "err_sq": sum_sq * 10.0 ** (-sqnr / 10.0),
                "subnormal": self.rng.integers(0, 100, (n, self.T)).astype(np.float64),
                "min_abs": amax * 2.0**-14,
            }
        else:
            extra = {}
        return extra | {
            "amax": amax,
            "scale": np.broadcast_to(self.scale, (n, self.T)).copy(),
            "overflow": np.zeros((n, self.T)),
            "underflow": self.rng.integers(0, 4, (n, self.T)).astype(np.float64),
            "nonfinite": np.zeros((n, self.T)),
            "numel": np.full((n, self.T), 1 << 20, dtype=np.float64),
        }


def batch_bytes(key: str, first_step: int, stats: dict[str, np.ndarray], encoding: str) -> bytes:
    """A telemetry body, already serialised (the client's cost is not what is measured)."""
    steps = []
    names = [*STATS, *QUALITY_COLUMNS] if encoding == "packed+quality" else STATS
    for i in range(len(stats["amax"])):
        if encoding.startswith("packed"):
            cols = {n: col(stats[n][i], "float32" if n in ("amax", "scale") else "float64") for n in names}
        else:
            cols = {n: stats[n][i].tolist() for n in STATS}
        steps.append(
            {
                "step": first_step + i,
                "scalars": {"loss": 2.5 - 1e-5 * (first_step + i), "lr": 3e-4},
                "stats": cols,
            }
        )
    return orjson.dumps({"idempotency_key": key, "steps": steps})


def create_run(url: str, T: int, name: str) -> int:
    r = httpx.post(
        f"{url}/api/v1/runs",
        json={"name": name, "tensors": tensors_for(T), "recipe": {"margin": 0}},
        timeout=30,
    )
    r.raise_for_status()
    return r.json()["id"]


def bench_ingest(url: str, encoding: str, T: int, S: int, batches: int, senders: int) -> dict:
    """Post `batches` batches from `senders` threads; values/s over the whole wall time."""
    run_id = create_run(url, T, f"bench-{encoding}")
    stream = StatStream(T)
    quality = encoding == "packed+quality"
    bodies = [batch_bytes(f"b{i}", i * S, stream.steps(S, quality), encoding) for i in range(batches + 2)]
    endpoint = f"{url}/api/v1/runs/{run_id}/telemetry"
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=60) as client:  # warm-up (engine, caches, connections)
        for body in bodies[:2]:
            client.post(endpoint, content=body, headers=headers).raise_for_status()
    work = bodies[2:]
    errors: list[str] = []
    latencies: list[float] = []

    def sender(part: list[bytes]) -> None:
        with httpx.Client(timeout=120) as client:
            for body in part:
                t0 = time.perf_counter()
                r = client.post(endpoint, content=body, headers=headers)
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200 or r.json()["stored_steps"] != S:
                    errors.append(f"{r.status_code}: {r.text[:200]}")

    threads = [threading.Thread(target=sender, args=(work[i::senders],)) for i in range(senders)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"ingest errors: {errors[:3]}")
    values = len(work) * S * T * (len(STATS) + (len(QUALITY_COLUMNS) if quality else 0))
    return {
        "values": values,
        "seconds": wall,
        "values_per_s": values / wall,
        "steps_per_s": len(work) * S / wall,
        "batch_bytes": len(work[0]),
        "batch_latency_median_ms": 1000 * statistics.median(latencies),
    }


def fill_direct(
    db_url: str, run_id: int, T: int, total_steps: int, chunk: int = 2000, quality: bool = False
) -> float:
    """Store `total_steps` steps through `store_batch` (the ingest storage code), no HTTP; returns seconds."""
    db = Database(db_url)
    stream = StatStream(T, seed=1)
    fp8_max = np.array([FP8_MAX[t["format"]] for t in tensors_for(T)])
    t0 = time.perf_counter()
    for first in range(0, total_steps, chunk):
        n = min(chunk, total_steps - first)
        stats = stream.steps(n, quality)
        # a few spikes and non-finite values, as a real run would have
        stats["amax"][n // 2, (first // chunk) % T] *= 1e3
        if first // chunk % 7 == 3:
            stats["amax"][1, 5] = np.nan
        batch = DecodedBatch(
            idempotency_key=f"fill-{first}",
            steps=np.arange(first, first + n, dtype=np.int64),
            scalars=[{"loss": 2.0} for _ in range(n)],
            stats=stats,
        )
        with db.run_lock(run_id), db.write() as session:
            store_batch(session, run_id, batch, fp8_max)
    seconds = time.perf_counter() - t0
    db.dispose()
    return seconds


def bench_heatmap(
    url: str, db_url: str, T: int, total_steps: int, repeats: int = 9, quality: bool = False
) -> dict:
    """Fill a T x total_steps run and time heatmap requests at max_cols=1000."""
    run_id = create_run(url, T, "bench-heatmap")
    fill_s = fill_direct(db_url, run_id, T, total_steps, quality=quality)
    out = {
        "steps": total_steps,
        "tensors": T,
        "fill_seconds": fill_s,
        "fill_values_per_s": total_steps
        * T
        * (len(STATS) + (len(QUALITY_COLUMNS) if quality else 0))
        / fill_s,
    }
    cases = {
        "amax_full": {"metric": "amax", "max_cols": 1000},
        "headroom_full": {"metric": "headroom", "max_cols": 1000},
        "amax_last_5000": {"metric": "amax", "max_cols": 1000, "from": total_steps - 5000},
    }
    if quality:
        cases["sqnr_full"] = {"metric": "sqnr", "max_cols": 1000}
    with httpx.Client(timeout=120) as client:
        for name, params in cases.items():
            times = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                r = client.get(f"{url}/api/v1/runs/{run_id}/heatmap", params=params)
                dt = time.perf_counter() - t0
                r.raise_for_status()
                if i:  # first request warms caches
                    times.append(dt)
            body = r.json()
            out[name] = {
                "median_ms": 1000 * statistics.median(times),
                "min_ms": 1000 * min(times),
                "columns": len(body["bucket_start"]),
                "bucket_width": body["bucket_width"],
                "response_bytes": len(r.content),
            }
    return out


def parse_args() -> argparse.Namespace:
    parser = doc_parser(__doc__)
    parser.add_argument("--tensors", type=int, default=512)
    parser.add_argument("--steps-per-batch", type=int, default=50)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--senders", type=int, default=2, help="concurrent HTTP clients")
    parser.add_argument("--heatmap-steps", type=int, default=100_000)
    parser.add_argument("--skip-pg", action="store_true")
    parser.add_argument("--backends", default="sqlite,postgresql", help="comma-separated: sqlite,postgresql")
    parser.add_argument("--skip-heatmap", action="store_true")
    parser.add_argument("--quality", action="store_true", help="also post and read the quality columns")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ingest.json")
    return parser.parse_args()


def measure_backend(backend: str, db_url: str, args: argparse.Namespace, results: dict) -> None:
    """Ingest in every encoding, then (unless skipped) the heatmap, against one backend's server; each
    result goes into `results` as it comes and is printed."""
    with running_server(db_url) as srv:
        url = srv.url
        for encoding in ("packed", "json", *(["packed+quality"] if args.quality else [])):
            r = bench_ingest(url, encoding, args.tensors, args.steps_per_batch, args.batches, args.senders)
            results["ingest"][f"{backend}/{encoding}"] = r
            print(f"  ingest {backend:10s} {encoding:6s} {r['values_per_s']:>12,.0f} values/s", flush=True)
        if not args.skip_heatmap:
            r = bench_heatmap(url, db_url, args.tensors, args.heatmap_steps, quality=args.quality)
            results["heatmap"][backend] = r
            print(f"  heatmap {backend:10s} amax {r['amax_full']['median_ms']:.1f} ms median", flush=True)


def print_tables(args: argparse.Namespace, results: dict) -> None:
    """The ingest table and (when measured) the heatmap table."""
    print()
    print(
        f"ingest: {args.tensors} tensors x 6 statistics x {args.steps_per_batch} steps per batch, "
        f"{args.batches} batches, {args.senders} concurrent senders, over HTTP"
    )
    print(
        f"{'backend':<12}{'encoding':<16}{'values/s':>14}{'steps/s':>10}{'batch p50 ms':>14}{'batch MB':>10}"
    )
    for key, r in results["ingest"].items():
        backend, encoding = key.split("/")
        print(
            f"{backend:<12}{encoding:<16}{r['values_per_s']:>14,.0f}{r['steps_per_s']:>10,.0f}"
            f"{r['batch_latency_median_ms']:>14.1f}{r['batch_bytes'] / 1e6:>10.2f}"
        )
    if not results["heatmap"]:
        return
    print()
    print(f"heatmap: {args.tensors} tensors x {args.heatmap_steps:,} steps, max_cols=1000, median of 9")
    print(
        f"{'backend':<12}{'query':<18}{'median ms':>10}{'min ms':>9}{'columns':>9}{'width':>7}"
        f"{'fill values/s':>15}"
    )
    for backend, r in results["heatmap"].items():
        for name in ("amax_full", "headroom_full", "amax_last_5000", "sqnr_full"):
            if name not in r:
                continue
            q = r[name]
            print(
                f"{backend:<12}{name:<18}{q['median_ms']:>10.1f}{q['min_ms']:>9.1f}{q['columns']:>9}"
                f"{q['bucket_width']:>7}{r['fill_values_per_s']:>15,.0f}"
            )


def goals(results: dict) -> dict[str, bool | None]:
    """SQLite's packed ingest rate and its heatmap median against the goals (None: not measured)."""
    sqlite_ingest = results["ingest"].get("sqlite/packed", {}).get("values_per_s", 0)
    sqlite_heatmap = results["heatmap"].get("sqlite", {}).get("amax_full", {}).get("median_ms")
    return {
        "sqlite_ingest_values_per_s>=1e6": sqlite_ingest >= 1e6,
        "sqlite_heatmap_median_ms<=150": None if sqlite_heatmap is None else sqlite_heatmap <= 150,
    }


def main() -> int:
    args = parse_args()
    backends = [b for b in args.backends.split(",") if not (args.skip_pg and b == "postgresql")]
    results: dict = {
        "machine": machine_info(),
        "params": vars(args) | {"out": str(args.out)},
        "ingest": {},
        "heatmap": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            ctx = (
                fresh_pg_database(PG_URL, "fp8scope_bench")
                if backend == "postgresql"
                else contextlib.nullcontext(f"sqlite:///{tmp}/bench.db")
            )
            with ctx as db_url:
                measure_backend(backend, db_url, args, results)
    print_tables(args, results)
    results["goals"] = goals(results)
    print()
    print("goals:", json.dumps(results["goals"]))
    write_json(args.out, results)
    print(f"wrote {shown_path(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
