"""The run page's store: the tensor list comes once (from the heatmap's header; no request of its own,
whatever the recipe editor and the drill-down need), and a failed request shows an error in its own panel
while the rest of the page is drawn."""

from __future__ import annotations

import pytest

from tests.web.browser import open_run
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
