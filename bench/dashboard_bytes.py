"""Benchmark: heatmap requests and bytes the run page of a many-tensor run fetches, per user action.

A run of 512 tensors is ingested over HTTP into a fresh SQLite `fp8-monitor serve`; headless Chromium opens
its run page and Playwright's network events count every heatmap request (`/heatmap` in the URL) and the
bytes of its response body, for each action in turn:

- draw: the run page opened, until its heatmap is drawn and the page is fully loaded (stream connected);
- hover: the mouse on one heatmap cell, until the tooltip shows every metric's value (the mouse moved
  onto the cell again once the tooltip's requests are answered: a page may fill it in on the next move);
- drill-down: a click on a layer in the layers table, until its drill-down is drawn;
- live refresh: one more step posted, until the heatmap holds it.

After each action the count waits until no heatmap request is in flight and none has started for
`--quiet` seconds (an action's requests may be chained: one answer triggers the next).

    .venv/bin/python bench/dashboard_bytes.py [--tensors 512] [--steps 3000]

Prints a table and writes bench/results/dashboard_bytes.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.dashboard import browser_bench_parser, chromium_missing, ingest  # noqa: E402  (its run, its options)
from bench.ingest import StatStream  # noqa: E402
from tests.support.server import API, batch_body, running_server  # noqa: E402
from tests.web.browser import CHROMIUM, CHROMIUM_ARGS, VIEWPORT, hover_cell, open_run  # noqa: E402


class HeatmapTraffic:
    """The page's heatmap requests as Playwright reports them: started, finished, and their body bytes."""

    def __init__(self, page: Any) -> None:
        self.started: list[str] = []
        self.finished: list[tuple[str, int]] = []
        self.last_start = time.monotonic()
        page.on("request", self._start)
        page.on("requestfinished", self._finish)
        page.on("requestfailed", self._finish_failed)

    @staticmethod
    def _mine(request: Any) -> bool:
        return API + "/runs/" in request.url and "/heatmap" in request.url

    def _start(self, request: Any) -> None:
        if self._mine(request):
            self.started.append(request.url)
            self.last_start = time.monotonic()

    def _finish(self, request: Any) -> None:
        if self._mine(request):
            response = request.response()
            self.finished.append((request.url, len(response.body()) if response else 0))

    def _finish_failed(self, request: Any) -> None:
        if self._mine(request):
            self.finished.append((request.url, 0))

    def mark(self) -> int:
        return len(self.finished)

    def settle(self, page: Any, quiet: float, timeout: float = 60.0) -> None:
        """Wait until every started request has finished and none started for `quiet` seconds (the
        page's event loop runs meanwhile, through Playwright's own waits)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            idle = len(self.finished) == len(self.started)
            if idle and time.monotonic() - self.last_start >= quiet:
                return
            page.wait_for_timeout(100)
        raise RuntimeError(f"heatmap requests still in flight after {timeout} s: {self.started}")

    def since(self, mark: int) -> dict:
        part = self.finished[mark:]
        return {
            "requests": len(part),
            "bytes": sum(n for _, n in part),
            "urls": [u.split(API, 1)[-1] for u, _ in part],
        }


def measure(url: str, run_id: int, T: int, steps: int, quiet: float) -> dict:
    from playwright.sync_api import sync_playwright

    out: dict[str, dict] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_context(viewport=VIEWPORT).new_page()
        traffic = HeatmapTraffic(page)

        mark = traffic.mark()
        open_run(page, url, run_id)
        traffic.settle(page, quiet)
        out["draw"] = traffic.since(mark)

        mark = traffic.mark()
        hover_cell(page, 5, 4)
        page.wait_for_selector("#tooltip:not([hidden])")
        traffic.settle(page, quiet)
        # then the tooltip complete (moved onto the cell again: a page may fill it in on the next hover)
        hover_cell(page, 5, 4)
        page.wait_for_function(
            "() => { const t = document.getElementById('tooltip');"
            " return !t.hidden && t.textContent.includes('underflow') && !t.textContent.includes('…'); }"
        )
        traffic.settle(page, quiet)
        out["hover"] = traffic.since(mark)

        mark = traffic.mark()
        page.mouse.move(5, 5)
        page.click("#layers-table tr.clickable >> nth=0")
        page.wait_for_selector("#drilldown-plot .main-svg")
        traffic.settle(page, quiet)
        out["drill-down"] = traffic.since(mark)

        mark = traffic.mark()
        body = orjson.dumps(
            batch_body("live-0", [steps], StatStream(T, seed=9).steps(1), encoding="float32", losses=[1.0])
        )
        httpx.post(
            f"{url}{API}/runs/{run_id}/telemetry", content=body, headers={"content-type": "application/json"}
        ).raise_for_status()
        deadline = time.monotonic() + 30
        while not any("/heatmap" in u for u, _ in traffic.finished[mark:]):
            if time.monotonic() > deadline:
                raise RuntimeError("no heatmap refresh within 30 s of a live step")
            page.wait_for_timeout(100)
        traffic.settle(page, quiet)
        out["live refresh"] = traffic.since(mark)
        browser.close()
    return out


def main() -> int:
    parser = browser_bench_parser(__doc__, 3000)
    parser.add_argument("--quiet", type=float, default=1.5, help="seconds without a new heatmap request")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "dashboard_bytes.json")
    args = parser.parse_args()
    if chromium_missing():
        return 2
    with tempfile.TemporaryDirectory() as tmp, running_server(f"sqlite:///{tmp}/bytes.db") as srv:
        print(f"ingesting {args.tensors} tensors x {args.steps:,} steps ...", flush=True)
        run_id, _ = ingest(srv.url, args.tensors, args.steps, 250, 2)
        actions = measure(srv.url, run_id, args.tensors, args.steps, args.quiet)
    print(f"\nrun page, {args.tensors} tensors x {args.steps:,} steps: heatmap requests per action")
    print(f"{'action':<14}{'requests':>9}{'bytes':>13}  requests")
    for name, a in actions.items():
        urls = "; ".join(a["urls"])
        print(f"{name:<14}{a['requests']:>9}{a['bytes']:>13,}  {urls[:300]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"params": vars(args) | {"out": str(args.out)}, "actions": actions}
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
