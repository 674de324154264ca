"""Benchmark: the dashboard's run page for a run of 512 tensors x 20,000 steps, in headless Chromium.

The run is ingested over HTTP (packed columns) into a fresh SQLite `fp8-monitor serve`. Then:

- time to a fully drawn run page, for two variants of the page in the same run, interleaved: today's, which
  paints a first frame on canvases before plotly.js has loaded, and the earlier one (`?paint=plotly`), which
  drew nothing until plotly.js (4.8 MB) had loaded and compiled. "Fully drawn" is the same for both: from
  navigation start (`performance.now()` = 0) until the heatmap's and the loss curve's pixels are on screen
  (the page stamps the frame after drawing each, whether on a canvas or by plotly). Also reported: the time
  until plotly's interactive plots are drawn. Cold (fresh browser context, empty cache) and warm (reload;
  plotly.js from the cache), with a breakdown from the Resource Timing API;
- the delay from a step POSTed to the API to its appearance on the open page (the page stamps `Date.now()`
  when the step's number is shown; the benchmark stamps `time.time()` just before the POST; same machine).

    .venv/bin/python bench/dashboard.py [--tensors 512] [--steps 20000] [--repeats 3] [--live 10]

Prints a table, writes bench/results/dashboard.json and a screenshot bench/results/dashboard.png.
Goals: drawn page <= 1.5 s cold, <= 0.8 s warm; step to page <= 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

from bench.ingest import StatStream, tensors_for  # noqa: E402  (the ingest benchmark's run shape)
from tests.support.server import batch_body, running_server  # noqa: E402  (the tests' wire encoders)
from tests.web.browser import CHROMIUM, CHROMIUM_ARGS, VIEWPORT  # noqa: E402  (as the browser tests)

API = "/api/v1"
GOAL_DRAWN_S = 1.5
GOAL_DRAWN_WARM_S = 0.8
GOAL_LIVE_S = 2.0


def ingest(url: str, T: int, steps: int, chunk: int, senders: int) -> tuple[int, float]:
    """Create the run and post `steps` steps in batches of `chunk` (float32-packed columns)."""
    r = httpx.post(
        f"{url}{API}/runs",
        json={"name": f"bench-dashboard-{T}x{steps}", "tensors": tensors_for(T), "host": "bench"},
        timeout=30,
    )
    r.raise_for_status()
    run_id = r.json()["id"]
    stream = StatStream(T, seed=3)
    rng = np.random.default_rng(4)
    bodies = []
    for first in range(0, steps, chunk):
        n = min(chunk, steps - first)
        stats = stream.steps(n)
        stats["amax"][n // 2, rng.integers(T)] *= 300.0  # an occasional spike, as a real run has
        if first == steps // 2:
            stats["amax"][3, 7] = np.nan
            stats["nonfinite"][3, 7] = 12
        loss = 3.0 * np.exp(-np.arange(first, first + n) / steps) + 0.05 * rng.random(n)
        body = batch_body(f"fill-{first}", range(first, first + n), stats, encoding="float32", losses=loss)
        for s in body["steps"]:
            s["scalars"]["grad_norm"] = 1.0
        bodies.append(orjson.dumps(body))
    errors: list[str] = []

    def send(part: list[bytes]) -> None:
        with httpx.Client(timeout=300) as client:
            for content in part:
                resp = client.post(
                    f"{url}{API}/runs/{run_id}/telemetry",
                    content=content,
                    headers={"content-type": "application/json"},
                )
                if resp.status_code != 200:
                    errors.append(resp.text[:200])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=send, args=(bodies[i::senders],)) for i in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"ingest failed: {errors[:2]}")
    return run_id, time.perf_counter() - t0


PAGE_TIMINGS = """() => {
    const p = window.fp8scope.painted;
    const d = window.fp8scope.drawn;
    const marks = window.fp8scope.marks || {};
    const res = performance.getEntriesByType('resource');
    const find = (part) => res.filter(r => r.name.includes(part)).map(r => ({
        start: r.startTime, end: r.responseEnd, bytes: r.decodedBodySize, url: r.name}));
    return {drawn: Math.max(p.heatmap, p.curves), heatmap: p.heatmap, curves: p.curves,
            interactive: Math.max(d.heatmap, d.curves),
            plotly: find('plotly.min.js'), heatmap_req: find('/heatmap/packed'),
            series: find('/series/multi'),
            query: window.fp8scope.heatmapQuery, plotly_ready: marks['plotly-ready'],
            heatmap_data: marks['heatmap-data'], curves_data: marks['curves-data']};
}"""
#: "fully drawn": both the heatmap's and the loss curve's pixels on screen (the page stamps the frame after
#: drawing them, on a canvas or by plotly, whichever came first), and plotly's plots drawn too (interactive)
DRAWN = (
    "() => ['heatmap', 'curves'].every(k => window.fp8scope.painted[k] !== undefined"
    " && window.fp8scope.drawn[k] !== undefined)"
)
#: the page variants compared: the first frame on canvases (today's page), and the page before it, which
#: drew nothing until plotly.js had loaded (kept behind ?paint=plotly)
VARIANTS = {"canvas first frame": "/", "wait for plotly": "/?paint=plotly"}


def time_page(browser, url: str, run_id: int, repeats: int) -> dict:
    """Per variant: cold loads (each in a fresh context) and warm reloads of the run page, the variants
    interleaved (their order alternating) so that load from other work on the machine hits both alike."""
    out = {name: {"cold": [], "warm": []} for name in VARIANTS}
    for i in range(repeats):
        names = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
        for name in names:
            context = browser.new_context(viewport=VIEWPORT)
            page = context.new_page()
            page.goto(f"{url}{VARIANTS[name]}#/runs/{run_id}")
            page.wait_for_function(DRAWN, timeout=60_000)
            out[name]["cold"].append(page.evaluate(PAGE_TIMINGS))
            for _ in range(2):
                page.reload()
                page.wait_for_function(DRAWN, timeout=60_000)
                out[name]["warm"].append(page.evaluate(PAGE_TIMINGS))
            context.close()
    return out


def live_delay(browser, url: str, run_id: int, T: int, first_step: int, n: int, shot: Path) -> list[float]:
    """Seconds from just before a step's POST to the page showing it, for `n` steps one at a time."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.on("console", lambda m: print("  page:", m.text) if m.type == "error" else None)
    page.goto(f"{url}/#/runs/{run_id}")
    page.wait_for_function(DRAWN, timeout=60_000)
    page.wait_for_function(f"() => (window.fp8scope.streams || []).includes('/runs/{run_id}/stream')")
    stream = StatStream(T, seed=3)  # the run's own distribution: live steps as quiet as the rest
    delays = []
    with httpx.Client(timeout=30) as client:
        for i in range(n):
            step = first_step + i
            body = orjson.dumps(
                batch_body(f"live-{step}", [step], stream.steps(1), encoding="float32", losses=[1.0])
            )
            posted = time.time()
            client.post(
                f"{url}{API}/runs/{run_id}/telemetry",
                content=body,
                headers={"content-type": "application/json"},
            ).raise_for_status()
            # poll from here: the page stamps the moment itself, so the polling period does not matter
            seen = None
            deadline = time.monotonic() + 10
            while seen is None and time.monotonic() < deadline:
                time.sleep(0.05)
                shown = page.evaluate("document.getElementById('run-last-step').textContent") == str(step)
                seen = page.evaluate(f"window.fp8scope.stepSeen['{run_id}:{step}']") if shown else None
            if seen is None:
                raise RuntimeError(f"step {step} did not appear on the page within 10 s")
            delays.append(seen / 1000.0 - posted)
            time.sleep(0.3)
    page.wait_for_timeout(8000)  # let the (throttled) live heatmap refresh include the new steps
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    context.close()
    return delays


def server_requests(url: str, run_id: int, query: dict, repeats: int = 5) -> dict:
    """The page's first requests timed alone from Python (median ms, bytes): the heatmap as packed binary
    (what the page uses) and as JSON, and the three scalar series in one request."""
    params = {k: v for k, v in query.items() if v is not None}
    cases = {
        "heatmap_packed": (f"/runs/{run_id}/heatmap/packed", params),
        "heatmap_json": (f"/runs/{run_id}/heatmap", params),
        "series_multi": (
            f"/runs/{run_id}/series/multi",
            {"name": ["loss", "lr", "grad_norm"], "max_points": 2000},
        ),
    }
    out = {}
    with httpx.Client(timeout=60) as client:
        for name, (path, p) in cases.items():
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                r = client.get(f"{url}{API}{path}", params=p)
                times.append(time.perf_counter() - t0)
                r.raise_for_status()
            out[name] = {"median_ms": 1000 * statistics.median(times), "bytes": len(r.content)}
    hm = httpx.get(f"{url}{API}/runs/{run_id}/heatmap", params=params, timeout=60).json()
    out["columns"] = len(hm["bucket_start"])
    out["bucket_width"] = hm["bucket_width"]
    return out


def browser_bench_parser(doc: str, steps: int) -> argparse.ArgumentParser:
    """The options every run-page benchmark starts with: the run's tensors and steps (``steps`` by
    default); ``doc`` (the script's docstring) is the help text."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=512)
    parser.add_argument("--steps", type=int, default=steps)
    return parser


def chromium_missing() -> bool:
    """Whether the Chromium the browser benchmarks drive is missing (said on stderr): nothing to measure."""
    if Path(CHROMIUM).exists():
        return False
    print(f"{CHROMIUM} is missing (apt-get install chromium)", file=sys.stderr)
    return True


def page_summary(samples: list[dict]) -> dict:
    """Medians of one variant's cold or warm loads, in seconds from navigation: each stage of the page
    (plotly.js loaded and executed, the heatmap requested and unpacked, each plot painted) and the whole."""
    pick = lambda key: statistics.median(s[key] for s in samples) / 1000.0  # noqa: E731
    plotly_end = [s["plotly"][0]["end"] for s in samples if s["plotly"]]
    hm = [s["heatmap_req"][0] for s in samples if s["heatmap_req"]]
    return {
        "plotly_js_executed_s": pick("plotly_ready"),
        "heatmap_data_s": pick("heatmap_data"),
        "curves_data_s": pick("curves_data"),
        "drawn_s": pick("drawn"),
        "interactive_s": pick("interactive"),
        "heatmap_drawn_s": pick("heatmap"),
        "curves_drawn_s": pick("curves"),
        "plotly_js_loaded_s": statistics.median(plotly_end) / 1000.0 if plotly_end else None,
        "heatmap_request_s": statistics.median(h["end"] - h["start"] for h in hm) / 1000.0 if hm else None,
        "heatmap_response_end_s": statistics.median(h["end"] for h in hm) / 1000.0 if hm else None,
        "samples_s": [s["drawn"] / 1000.0 for s in samples],
    }


def measure(args: argparse.Namespace, shot: Path) -> dict:
    """The whole measurement on a fresh server: the run ingested, the page loads of every variant, the
    live delays (and the screenshot), and the page's first requests timed alone."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp, running_server(f"sqlite:///{tmp}/dash.db") as srv:
        print(f"ingesting {args.tensors} tensors x {args.steps:,} steps ...", flush=True)
        run_id, ingest_s = ingest(srv.url, args.tensors, args.steps, args.chunk, args.senders)
        print(f"  {ingest_s:.1f} s ({args.tensors * args.steps * 6 / ingest_s:,.0f} values/s)", flush=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            loads = time_page(browser, srv.url, run_id, args.repeats)
            delays = live_delay(browser, srv.url, run_id, args.tensors, args.steps, args.live, shot)
            browser.close()
        first = next(iter(VARIANTS))
        alone = server_requests(srv.url, run_id, loads[first]["cold"][0]["query"])
    return {"ingest_seconds": ingest_s, "loads": loads, "delays": delays, "alone": alone}


def build_results(args: argparse.Namespace, measured: dict) -> dict:
    """The JSON: the machine (its load too: other work slows both server and browser), the parameters,
    each variant's summaries, the requests alone, the live delays and the goals on today's page."""
    loads, delays = measured["loads"], measured["delays"]
    first = next(iter(VARIANTS))
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_1min_at_end": os.getloadavg()[0],
        },
        "params": vars(args) | {"out": str(args.out)},
        "ingest_seconds": measured["ingest_seconds"],
        "pages": {
            name: {"cold": page_summary(v["cold"]), "warm": page_summary(v["warm"])}
            for name, v in loads.items()
        },
        "heatmap_query": loads[first]["cold"][0]["query"],
        "requests_alone": measured["alone"],
        "live_delay_s": {"median": statistics.median(delays), "max": max(delays), "samples": delays},
    }
    page = results["pages"][first]
    results["goals"] = {
        f"drawn_cold_s<={GOAL_DRAWN_S}": page["cold"]["drawn_s"] <= GOAL_DRAWN_S,
        f"drawn_warm_s<={GOAL_DRAWN_WARM_S}": page["warm"]["drawn_s"] <= GOAL_DRAWN_WARM_S,
        f"live_max_s<={GOAL_LIVE_S}": max(delays) <= GOAL_LIVE_S,
    }
    return results


def as_ms(v: float | None) -> str:
    """Seconds shown as whole milliseconds; "-" where the page did not report the stage."""
    return f"{1000 * v:.0f}" if v is not None else "-"


def print_pages(results: dict, args: argparse.Namespace) -> None:
    """The headline table: fully drawn and interactive, cold and warm, per variant."""
    print()
    print(
        f"run page, {args.tensors} tensors x {args.steps:,} steps, headless Chromium, {args.repeats} cold "
        "loads and 2 warm reloads after each per variant, interleaved; medians, ms from navigation"
    )
    print("fully drawn: heatmap and loss curve pixels on screen; interactive: plotly's plots drawn")
    head = f"{'variant':<22}{'cold ms':>9}{'warm ms':>9}{'interactive cold':>18}{'warm':>7}"
    print(head)
    print("-" * len(head))
    for name, p in results["pages"].items():
        c, w = p["cold"], p["warm"]
        drawn = f"{as_ms(c['drawn_s']):>9}{as_ms(w['drawn_s']):>9}"
        print(f"{name:<22}{drawn}{as_ms(c['interactive_s']):>18}{as_ms(w['interactive_s']):>7}")
    print(
        f"goals: fully drawn cold <= {1000 * GOAL_DRAWN_S:.0f} ms, warm <= {1000 * GOAL_DRAWN_WARM_S:.0f} ms"
    )


BREAKDOWN = (
    ("plotly.js downloaded", "plotly_js_loaded_s"),
    ("plotly.js executed", "plotly_js_executed_s"),
    ("heatmap response complete", "heatmap_response_end_s"),
    ("  of which the request itself", "heatmap_request_s"),
    ("heatmap data unpacked", "heatmap_data_s"),
    ("curves data parsed", "curves_data_s"),
    ("curves painted", "curves_drawn_s"),
    ("heatmap painted", "heatmap_drawn_s"),
    ("fully drawn", "drawn_s"),
    ("interactive (plotly)", "interactive_s"),
)


def print_breakdown(pages: dict) -> None:
    """Each stage of the page, cold and warm, per variant: where the time to a drawn page goes."""
    print()
    names = list(pages)
    print(f"{'breakdown (ms)':<30}" + "".join(f"{n:>22}{'':>6}" for n in names))
    print(f"{'':<30}" + f"{'cold':>22}{'warm':>6}" * len(names))
    for label, key in BREAKDOWN:
        cells = "".join(f"{as_ms(pages[n]['cold'][key]):>22}{as_ms(pages[n]['warm'][key]):>6}" for n in names)
        print(f"{label:<30}{cells}")


def print_requests_and_live(results: dict) -> None:
    """The heatmap's shape and the first requests timed alone, the live delay, the machine's load."""
    q, a = results["heatmap_query"], results["requests_alone"]
    print(f"heatmap: max_cols={q['max_cols']} -> {a['columns']} columns of {a['bucket_width']} steps")
    for name in ("heatmap_packed", "heatmap_json", "series_multi"):
        print(f"  {name:<16} alone: {a[name]['median_ms']:6.0f} ms, {a[name]['bytes'] / 1e6:6.2f} MB")
    d = results["live_delay_s"]
    print(f"step POSTed -> shown on the page: median {d['median']:.3f} s, max {d['max']:.3f} s (goal <= 2)")
    print(f"load average (1 min) at the end: {results['machine']['load_average_1min_at_end']:.1f}")
    print("goals:", json.dumps(results["goals"]))


def main() -> int:
    parser = browser_bench_parser(__doc__, 20_000)
    parser.add_argument("--chunk", type=int, default=250, help="steps per telemetry batch")
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="cold page loads (each followed by 2 warm)")
    parser.add_argument("--live", type=int, default=10, help="steps posted one by one for the live delay")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "dashboard.json")
    args = parser.parse_args()
    if chromium_missing():
        return 2
    shot = args.out.with_suffix(".png")
    results = build_results(args, measure(args, shot))
    print_pages(results, args)
    print_breakdown(results["pages"])
    print_requests_and_live(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(
        f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out} and {shot.name}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
