"""The run page's store: the tensor list comes once (from the heatmap's header; no request of its own,
whatever the recipe editor and the drill-down need), and a failed request shows an error in its own panel
while the rest of the page is drawn."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.web.browser import no_page_errors, open_run
from tests.web.dashboard_data import create_run, post_steps, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

N_LAYERS = 3


def make_run(server) -> dict:
    run = create_run(server.url, "store-run", N_LAYERS)
    post_steps(server.url, run["id"], "b0", 0, smooth_stats(200, 3 * N_LAYERS))
    return run


def test_tensor_list_is_not_fetched_per_panel(server, page):
    run = make_run(server)
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    open_run(page, server.url, run["id"], stream=False)
    # the recipe editor's targets are the run's layers
    page.wait_for_selector("#recipe-target option[value='blocks.2.mlp.fc']", state="attached")
    # the drill-down has the layer's three tensors
    page.click("#layers-table tr:has(td.name:text-is('blocks.1.mlp.fc'))")
    page.wait_for_selector("#drilldown-plot .main-svg")
    names = page.evaluate(
        "[...new Set(document.getElementById('drilldown-plot').data.filter(t => t.mode === 'lines')"
        ".map(t => t.name))]"
    )
    assert sorted(names) == ["grad_output", "input", "weight"]
    assert [u for u in requests if u.split("?")[0].endswith("/tensors")] == []


@pytest.mark.parametrize(
    ("path", "selector", "text"),
    [
        ("/layers", "#layers-error", "Could not load the layers"),
        ("/incidents", "#incidents-error", "Could not load the incidents"),
        ("/commands", "#commands-error", "Could not load the audit trail"),
        ("/events", "#events-error", "Could not load the run's events"),
    ],
)
def test_failed_request_shows_error_in_its_panel(server, page, path, selector, text):
    run = make_run(server)
    page.route(
        f"**/api/v1/runs/{run['id']}{path}*",
        lambda route: (
            route.fulfill(status=500, content_type="application/json", body='{"detail": "boom"}')
            if route.request.method == "GET"
            else route.continue_()
        ),
    )
    open_run(page, server.url, run["id"], stream=False)
    cell = page.wait_for_selector(selector)
    assert cell.text_content().startswith(text)
    # the page itself stands: the header and the other panels
    assert page.text_content("#run-name") == "store-run"
    assert page.evaluate("document.querySelector('#app > p.error')") is None
    page.wait_for_selector("#config-table tbody tr")
    assert page.evaluate("window.fp8scope.errors") == []


def reads(requests: list, path: str) -> list[str]:
    """The GET requests of the page whose path ends with `path` (e.g. "/alerts"), in order."""
    return [r.url for r in requests if r.method == "GET" and r.url.split("?")[0].endswith(path)]


def test_alerts_are_read_once_per_refresh_not_once_per_panel(server, page):
    """The incidents panel, the verdict, the curves' markers, the post-mortem and the layers' ranking all
    render the store's alerts: one request for the alerts (and one for the incidents) on load and on each
    refresh, none for a live alert (the stream brings it)."""
    run = make_run(server)
    rid = run["id"]
    bad = smooth_stats(1, 3 * N_LAYERS, seed=2)
    bad["amax"][0, 3] = np.inf
    bad["nonfinite"][0, 3] = 5  # blocks.1's input at step 200
    post_steps(server.url, rid, "bad", 200, bad)
    requests: list = []
    page.on("request", lambda r: requests.append(r))
    open_run(page, server.url, rid)
    page.wait_for_selector("#incidents-list li.incident")
    # the post-mortem names the first non-finite value from the same alerts
    page.wait_for_selector("#first-nonfinite")
    assert page.text_content("#first-nonfinite .name") == "blocks.1.mlp.fc.input"
    assert len(reads(requests, "/alerts")) == 1, reads(requests, "/alerts")
    assert len(reads(requests, "/incidents")) == 1, reads(requests, "/incidents")

    # a live update: a second fault arrives by the stream, in the panel and the layers' ranking, unrequested
    later = smooth_stats(3, 3 * N_LAYERS, seed=3)
    later["overflow"][1, 4] = 0.5 * 4096  # blocks.1's weight saturates at step 401
    post_steps(server.url, rid, "later", 400, later)
    page.wait_for_function("() => document.querySelectorAll('#incidents-list li.incident').length === 2")
    page.wait_for_function("() => document.getElementById('run-open-incidents').textContent === '2'")
    assert len(reads(requests, "/alerts")) == 1, reads(requests, "/alerts")
    assert len(reads(requests, "/incidents")) == 1, reads(requests, "/incidents")

    # a refresh (acknowledging all re-reads the incidents and their alerts): one more of each
    def answered(path):
        return lambda r: r.request.method == "GET" and r.url.split("?")[0].endswith(f"/runs/{rid}{path}")

    with page.expect_response(answered("/alerts")), page.expect_response(answered("/incidents")):
        page.click("#ack-all")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#incidents-list li.incident')]"
        ".every(li => li.dataset.state === 'acknowledged')"
    )
    assert len(reads(requests, "/alerts")) == 2, reads(requests, "/alerts")
    assert len(reads(requests, "/incidents")) == 2, reads(requests, "/incidents")
    no_page_errors(page)


def test_nonfinite_alerts_left_out_of_a_full_list_are_read_apart(server, page):
    """A flood of other alerts fills the alert list: the nonfinite ones it may have left out (they name the
    run's first non-finite value) are read apart, and the post-mortem still names it."""
    run = make_run(server)
    rid = run["id"]
    bad = smooth_stats(1, 3 * N_LAYERS, seed=2)
    bad["amax"][0, 5] = np.nan
    bad["nonfinite"][0, 5] = 5  # blocks.1's grad_output at step 200
    post_steps(server.url, rid, "bad", 200, bad)
    flooding = {"run_id": rid, "kind": "underflow", "severity": "info", "state": "acknowledged"}
    where = {"tensor_index": None, "tensor_name": None, "layer": None, "incident_id": 10_000_000}
    steps = {"first_step": 1, "last_step": 1, "onset_step": 1, "count": 1}
    flood = [
        {"id": 10_000_000 + k, **flooding, **where, **steps, "message": "flood", "evidence": {}}
        for k in range(500)
    ]

    def full_list(route):
        if "kind=" in route.request.url:
            route.continue_()
        else:
            route.fulfill(status=200, content_type="application/json", body=json.dumps(flood))

    page.route(lambda url: url.split("?")[0].endswith(f"/api/v1/runs/{rid}/alerts"), full_list)
    requests: list = []
    page.on("request", lambda r: requests.append(r))
    open_run(page, server.url, rid, stream=False)
    page.wait_for_selector("#first-nonfinite")
    assert page.text_content("#first-nonfinite .name") == "blocks.1.mlp.fc.grad_output"
    alerts = reads(requests, "/alerts")
    assert len(alerts) == 2 and "kind=nonfinite" in alerts[1], alerts
    no_page_errors(page)
