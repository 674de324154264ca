"""What the block scale exponent histograms cost the service: ingest with the block columns and a histogram
per block-scaled tensor and step against the block columns alone (the same steps, packed float64 columns,
through the real app in process on SQLite), and `GET /runs/{id}/block-histogram` of one tensor over the
whole run at two widths.

    python bench/block_hist.py                 # 32 layers (96 tensors, 64 block-scaled), 2,000 steps
    python bench/block_hist.py --steps 500     # quicker

Ingest is timed as the client sees it (its JSON encoding included), interleaved, best of two runs each.
Prints a table (ms per step ingested, ms per answer) and writes bench/results/block_hist.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastapi.testclient import TestClient  # noqa: E402

from fp8_protocol.stats import BASE_COLUMNS, BLOCK_COLUMNS  # noqa: E402
from monitor_server.app import create_app  # noqa: E402
from monitor_server.core.config import Settings  # noqa: E402
from tests.support.server import API, col, random_stats, run_body  # noqa: E402

BATCH = 50


def steps_of(rng: np.random.Generator, first: int, n: int, tensors: int, hist: bool) -> list[dict]:
    """`n` steps of base and block columns; with `hist`, a histogram over 4..8 exponents for each
    block-scaled tensor (the first two of every three)."""
    stats = random_stats(rng, n, tensors)
    scaled = np.arange(tensors) % 3 != 2
    stats |= {
        "blocks": np.where(scaled, 4096.0, 0.0) * np.ones((n, 1)),
        "blocks_at_limit": np.zeros((n, tensors)),
        "blocks_overflow": rng.integers(0, 3, (n, tensors)) * scaled,
        "blocks_underflow": rng.integers(0, 40, (n, tensors)) * scaled,
        "block_range": rng.uniform(3, 12, (n, tensors)) * scaled,
    }
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
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "block_hist.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
