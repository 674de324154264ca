"""Detector cost on the ingest path: time of `DetectorEngine.process` and of persisting its state, per
telemetry batch of 50 steps x 513 tensors, for a healthy run and for a batch in which every tensor goes
non-finite and overflows (the worst case: a finding per tensor). Printed beside the time the same batch
takes to decode (the ingest's own per-batch CPU work before any database write), measured in the same run.

    python bench/detectors.py [--batches 40] [--layers 171]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from monitor_server.detectors.engine import DetectorConfig, DetectorEngine  # noqa: E402
from monitor_server.services.ingest import decode_batch, parse_json  # noqa: E402
from tests.server.detectors.runs import healthy_run  # noqa: E402  (the detector tests' synthetic runs)
from tests.support.server import batch_body  # noqa: E402  (the wire encodings the tests use)

STEPS = 50


def _timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--layers", type=int, default=171, help="3 tensors per layer")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "detectors.json")
    args = p.parse_args()

    run = healthy_run(n_steps=STEPS * (args.batches + 2), n_layers=args.layers)
    T = len(run.tensors)
    batches = run.batches(list(range(STEPS, STEPS * (args.batches + 2), STEPS)))
    engine = DetectorEngine(DetectorConfig(), run.tensors, {"margin": 0, "amax_history_len": 1024})
    engine.process(batches[0])  # warm-up: the first batch fills the windows

    healthy, persist = [], []
    for b in batches[1 : args.batches + 1]:
        healthy += _timed(lambda b=b: engine.process(b), 1)
        persist += _timed(lambda: json.dumps(engine.state_dict()), 1)

    # worst case: one more batch where every tensor is non-finite and saturating
    bad = batches[args.batches + 1]
    bad.stats["nonfinite"][:] = 1.0
    bad.stats["amax"][:, :] = np.nan
    bad.stats["overflow"][:] = bad.stats["numel"] * 0.5
    t0 = time.perf_counter()
    findings = engine.process(bad)
    worst = (time.perf_counter() - t0) * 1e3

    rows = [("detectors: healthy batch", healthy), ("detectors: state_dict + json.dumps", persist)]
    first = batches[1]
    for encoding in ("float64", "json"):
        body = json.dumps(
            batch_body("bench", first.steps, dict(first.stats), encoding, losses=first.scalars["loss"])
        ).encode()
        decode = lambda b=body: decode_batch(parse_json(b), T)  # noqa: E731
        rows.append((f"ingest decode ({encoding}, {len(body) / 1e6:.2f} MB)", _timed(decode, 9)))
    print(f"per batch of {STEPS} steps x {T} tensors, median over {args.batches} batches (decode: 9 reps)")
    print(f"{'what':44s} {'median ms':>10s} {'p90 ms':>8s}")
    result = {"steps_per_batch": STEPS, "tensors": T}
    for name, times in rows:
        print(f"{name:44s} {np.median(times):10.2f} {np.percentile(times, 90):8.2f}")
        result[name] = {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90))}
    print(f"{'detectors: worst-case batch (' + str(len(findings)) + ' findings)':44s} {worst:10.2f}")
    result["worst_case_ms"], result["worst_case_findings"] = worst, len(findings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
