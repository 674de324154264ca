"""What building an answer from its response model costs, for the large answers: the JSON heatmap (512
tensors x 2000 buckets), a series of 100,000 points and 16 series of 2,000 (`GET /runs/{id}/series/multi`).

For each: the bytes written from a plain dict with orjson (no model), the route's way (the model built and
validated, then written with orjson; the heatmap's head only, its matrix spliced in as `matrix_json` renders
it) and, for the heatmap, the whole matrix through `HeatmapPublic`, the path the route avoids. The database
read before it is the same in all and is left out.

    python bench/responses.py            # best of 7, the ways interleaved (about 15 s on 2 cores)

Prints a table of milliseconds per answer and writes bench/results/responses.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp8_protocol.codec import jsonable  # noqa: E402
from fp8_protocol.tensors import TensorInfo  # noqa: E402
from monitor_server.api.responses import model_json  # noqa: E402
from monitor_server.infra.wire import matrix_json  # noqa: E402
from monitor_server.storage.query_schemas import HeatmapHead, HeatmapPublic, SeriesMulti, SeriesPublic  # noqa: E402
from monitor_server.storage.series import downsample_minmax, series_points  # noqa: E402


def heatmap_case(tensors: int, buckets: int) -> dict[str, callable]:
    rng = np.random.default_rng(0)
    values = np.exp(rng.normal(0.0, 2.0, size=(tensors, buckets)))
    values[3, 7], values[5, 9] = np.nan, np.inf
    empty = np.zeros(buckets, dtype=bool)
    empty[100:110] = True
    values[:, empty] = np.nan
    metas = [
        TensorInfo(i, f"blocks.{i // 3}.fc.t{i % 3}", f"blocks.{i // 3}.fc", "input", "e4m3")
        for i in range(tensors)
    ]
    head = {
        "metric": "amax",
        "aggregation": "max",
        "tensors": [asdict(t) for t in metas],
        "bucket_width": 10,
        "bucket_start": list(range(0, 10 * buckets, 10)),
        "bucket_end": list(range(9, 10 * buckets, 10)),
        "bucket_steps": [0 if e else 10 for e in empty.tolist()],
    }

    def plain() -> bytes:
        return orjson.dumps(head)[:-1] + b',"values":' + matrix_json(values, empty) + b"}"

    def route() -> bytes:
        return model_json(HeatmapHead(**head))[:-1] + b',"values":' + matrix_json(values, empty) + b"}"

    def whole_model() -> bytes:
        cells = jsonable(values.tolist())
        for row in cells:
            for c in np.flatnonzero(empty).tolist():
                row[c] = None
        return model_json(HeatmapPublic(**head, values=cells))

    assert orjson.loads(route()) == orjson.loads(whole_model()) == orjson.loads(plain())
    return {"plain dict": plain, "route (head model + splice)": route, "whole model": whole_model}


def _points(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    values = np.random.default_rng(seed).normal(2.0, 0.1, n)
    values[n // 3] = np.nan
    return np.arange(n, dtype=np.int64), values


def series_case(n: int, max_points: int) -> dict[str, callable]:
    steps, values = _points(n, 1)

    def plain() -> bytes:
        kept_steps, kept_values, width = downsample_minmax(steps, values, max_points)
        out = {"name": "loss", "from": 0, "to": n - 1, "bucket_width": width}
        out.update(
            downsampled=len(kept_steps) < n, steps=kept_steps.tolist(), values=jsonable(kept_values.tolist())
        )
        return orjson.dumps(out)

    def route() -> bytes:
        series = series_points(
            steps, values, max_points, SeriesPublic, name="loss", from_step=0, to_step=n - 1
        )
        return model_json(series)

    assert orjson.loads(plain()) == orjson.loads(route())
    return {"plain dict": plain, "route (model)": route}


def multi_case(names: int, n: int, max_points: int) -> dict[str, callable]:
    series = {f"s{i}": _points(n, i) for i in range(names)}

    def plain() -> bytes:
        out = {"from": 0, "to": n - 1, "series": {}}
        for name, (steps, values) in series.items():
            kept_steps, kept_values, width = downsample_minmax(steps, values, max_points)
            out["series"][name] = {
                "bucket_width": width,
                "downsampled": len(kept_steps) < n,
                "steps": kept_steps.tolist(),
                "values": jsonable(kept_values.tolist()),
            }
        return orjson.dumps(out)

    def route() -> bytes:
        points = {name: series_points(s, v, max_points) for name, (s, v) in series.items()}
        return model_json(SeriesMulti(from_step=0, to_step=n - 1, series=points))

    assert orjson.loads(plain()) == orjson.loads(route())
    return {"plain dict": plain, "route (model)": route}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="best of this many timings")
    args = parser.parse_args()
    cases = {
        "heatmap 512 x 2000": heatmap_case(512, 2000),
        "series 100,000 points": series_case(100_000, 100_000),
        "series/multi 16 x 2,000": multi_case(16, 20_000, 2000),
    }
    results: dict[str, dict[str, float]] = {}
    print(f"{'answer':<26} {'way':<30} {'ms':>9} {'x plain':>8}")
    for case, ways in cases.items():
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(args.repeat):  # interleaved, so a busy moment costs every way alike
            for way, fn in ways.items():
                start = time.perf_counter()
                fn()
                best[way] = min(best[way], time.perf_counter() - start)
        results[case] = {way: s * 1e3 for way, s in best.items()}
        for way, ms in results[case].items():
            print(f"{case:<26} {way:<30} {ms:9.1f} {ms / results[case]['plain dict']:8.2f}")
    out = ROOT / "bench" / "results" / "responses.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
