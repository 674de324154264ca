"""How the browser tests and bench/dashboard.py start Chromium (Debian's build, headless, quiet), and what
the tests wait for on a page."""

from __future__ import annotations

import time
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: a laptop screen
VIEWPORT = {"width": 1366, "height": 860}


def wait_drawn(page: Any, *kinds: str, timeout: float = 15_000) -> None:
    """Wait until the page reports the plots `kinds` drawn (plotly afterplot with data loaded)."""
    page.wait_for_function(
        "kinds => kinds.every(k => window.fp8scope && window.fp8scope.drawn[k] !== undefined)",
        arg=list(kinds),
        timeout=timeout,
    )


def wait_stream(page: Any, path: str, timeout: float = 10_000) -> None:
    """Wait until the page's event stream at `path` (e.g. "/runs/3/stream") is connected."""
    page.wait_for_function("p => (window.fp8scope.streams || []).includes(p)", arg=path, timeout=timeout)


def open_run(page: Any, url: str, run_id: int | str, *, stream: bool = True) -> None:
    """Open the page of run `run_id` and wait until its heatmap and curves are drawn, its verdict line is
    complete and, with `stream`, its event stream is connected."""
    page.goto(f"{url}/#/runs/{run_id}")
    wait_drawn(page, "heatmap", "curves")
    # the verdict under the header has its incidents: nothing above the plots moves after this
    page.wait_for_selector("#run-verdict[data-kind]")
    if stream:
        wait_stream(page, f"/runs/{run_id}/stream")


#: counts, per path, the JSON answers the page has read; the page's code that awaited one runs on in the same
#: task as the count, so a condition on the count waits until an answer has been handled
_COUNT_JSON_READS = """
window.jsonReads = {};
const json = Response.prototype.json;
Response.prototype.json = function () {
  const path = new URL(this.url).pathname;
  return json.call(this).then((v) => {
    window.jsonReads[path] = (window.jsonReads[path] || 0) + 1;
    return v;
  });
};
"""


def count_json_reads(page: Any) -> None:
    """From the page's next load on, count the JSON answers it reads, per path (`json_reads`)."""
    page.add_init_script(_COUNT_JSON_READS)


def json_reads(page: Any, path: str) -> int:
    """How many JSON answers from `path` (e.g. "/api/v1/runs/3") the page has read and handled."""
    return int(page.evaluate("p => window.jsonReads[p] || 0", path))


def wait_json_reads(page: Any, path: str, n: int, timeout: float = 15_000) -> None:
    """Wait until the page has read and handled `n` JSON answers from `path`."""
    page.wait_for_function("([p, n]) => (window.jsonReads[p] || 0) >= n", arg=[path, n], timeout=timeout)


class FirstReadHeld:
    """Holds the page's first request whose URL `matches`: the service answers it at once (what it held at
    that moment) and the page gets that answer only at `release()`; later requests go through."""

    def __init__(self, page: Any, matches: Any):
        self.page, self.matches = page, matches
        self.held: list[tuple[Any, Any]] = []  # (route, the service's answer)
        page.route(matches, self._route)

    def _route(self, route: Any) -> None:
        if self.held:
            route.continue_()
        else:
            self.held.append((route, route.fetch()))

    def wait(self, what: str, timeout_s: float = 15.0) -> None:
        """Wait until a request is held (`what`: the failure's message)."""
        deadline = time.monotonic() + timeout_s
        while not self.held:  # the route handler runs while Playwright is called
            assert time.monotonic() < deadline, what
            self.page.wait_for_timeout(20)

    def release(self) -> None:
        """Hand the held answer to the page; stop holding."""
        route, answer = self.held[0]
        route.fulfill(response=answer)
        self.page.unroute(self.matches)


def no_page_errors(page: Any) -> None:
    """Assert the page raised nothing (console errors for failed fetches of a 401 excepted by callers)."""
    assert not page.probe.errors, page.probe.errors
    assert not page.evaluate("window.fp8scope.errors"), page.evaluate("window.fp8scope.errors")


class PlotlyGate:
    """Holds the page's request for plotly.js until `release()`: what the page draws before plotly arrives
    (the first frame) can be looked at, then the hand-over to plotly."""

    def __init__(self, page: Any):
        self.held: list[Any] = []
        self.released = False
        page.route("**/vendor/plotly.min.js", self._route)

    def _route(self, route: Any) -> None:
        if self.released:
            route.continue_()
        else:
            self.held.append(route)

    def release(self) -> None:
        self.released = True
        for route in self.held:
            route.continue_()


#: heatmap cell (col, row) -> the page's pixel at its centre, from the plot's own axes
_CELL_XY = """([c, r]) => { const gd = document.getElementById('heatmap'); const L = gd._fullLayout;
    const box = gd.querySelector('.nsewdrag').getBoundingClientRect(); const t = gd.data[0];
    return [box.x + L.xaxis.l2p(t.x0 + c * t.dx), box.y + L.yaxis.l2p(r)]; }"""


def hover_cell(page: Any, col: int, row: int) -> None:
    """Move the mouse onto heatmap cell (row, col), the page scrolled to show it first (two moves: plotly
    hovers on a move, not on where the mouse already is)."""
    _, y = page.evaluate(_CELL_XY, [col, row])
    page.evaluate(f"window.scrollTo(0, {max(0, y - 300)})")
    x, y = page.evaluate(_CELL_XY, [col, row])
    page.mouse.move(x - 2, y)
    page.mouse.move(x, y)
