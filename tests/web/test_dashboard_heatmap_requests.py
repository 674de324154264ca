"""What the run page of a many-tensor run asks the service for its heatmap: one request per drawing (the
metric and the non-finite counts together), one of only the hovered layer's rows for a tooltip, one of
only a layer's rows for its drill-down, and on a live step only the buckets after those held; and what it
draws from them is what was posted."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest

from tests.support.server import API
from tests.web.browser import hover_cell, no_page_errors, open_run
from tests.web.dashboard_data import create_run, post_steps, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

N_LAYERS = 171  # 513 tensors: tensor 3k + j is layer k's input, weight, grad_output (rows in that order)
STEPS = 60  # fewer than the plot's columns: a bucket per step


class HeatmapRequests:
    """The heatmap requests the page sends, as (path, query) in order."""

    def __init__(self, page) -> None:
        self.sent: list[tuple[str, dict[str, str]]] = []
        page.on("request", self._seen)

    def _seen(self, request) -> None:
        url = urlsplit(request.url)
        if url.path.startswith(f"{API}/runs/") and "/heatmap" in url.path:
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            self.sent.append((url.path, query))

    def since(self, mark: int) -> list[dict[str, str]]:
        return [query for _, query in self.sent[mark:]]


def drawn_z(page) -> list[list[float | None]]:
    return page.evaluate("document.getElementById('heatmap').data[0].z")


def test_one_request_per_view_of_only_the_rows_it_draws(server, page):
    run = create_run(server.url, "many-tensors", N_LAYERS)
    T = 3 * N_LAYERS
    stats = smooth_stats(STEPS + 4, T, seed=5)
    stats["nonfinite"][20, 7] = 3  # a marked cell: the counts come with the drawing's one request
    post_steps(server.url, run["id"], "a", 0, {k: v[:STEPS] for k, v in stats.items()})
    requests = HeatmapRequests(page)

    # the drawing: one request, of the shown metric and the non-finite counts; the cells are the posted amax
    open_run(page, server.url, run["id"])
    page.wait_for_function(
        "() => document.getElementById('heatmap').data.some(t => t.name === 'non-finite elements')"
    )
    (draw,) = requests.since(0)
    assert draw["metrics"] == "amax,nonfinite" and "tensors" not in draw and "layer" not in draw
    z = np.array(drawn_z(page), dtype=float)
    assert z.shape == (T, STEPS)
    np.testing.assert_allclose(z, np.log2(stats["amax"][:STEPS].T), rtol=1e-15)
    marked = page.evaluate(
        "document.getElementById('heatmap').data.find(t => t.name === 'non-finite elements').customdata"
    )
    assert marked == [[7, 20]]

    # a tooltip: one request, of the other metrics of the hovered tensor's layer only
    mark = len(requests.sent)
    tensor, col = 4, 10  # blocks.1.mlp.fc.weight
    hover_cell(page, col, tensor)
    page.wait_for_function(
        "() => { const t = document.getElementById('tooltip');"
        " return !t.hidden && t.textContent.includes('underflow') && !t.textContent.includes('…'); }"
    )
    (hover,) = requests.since(mark)
    assert hover["layer"] == "blocks.1.mlp.fc" and hover["metrics"] == "scale,overflow,underflow"
    lines = dict(
        line.split(" ", 1) for line in page.locator("#tooltip div").all_text_contents()[1:] if " " in line
    )
    assert float(lines["scale"]) == stats["scale"][col, tensor]  # a power of two, written whole
    assert lines["underflow"] == str(int(stats["underflow"][col, tensor]))
    assert lines["overflow"] == "0" and lines["nonfinite"] == "0"
    # another tensor of the same layer: no request
    hover_cell(page, col + 1, tensor + 1)
    page.wait_for_function(
        "() => document.getElementById('tooltip').textContent.includes('blocks.1.mlp.fc.grad_output')"
    )
    assert len(requests.sent) == mark + 1

    # a drill-down: one request, of six metrics of that layer's rows only; its lines are the posted amax
    page.mouse.move(5, 5)
    mark = len(requests.sent)
    row = page.locator("#layers-table tr.clickable").first
    layer = row.locator("td.name").first.text_content().strip()
    row.click()
    page.wait_for_selector("#drilldown-plot .main-svg")
    (drill,) = requests.since(mark)
    assert drill["layer"] == layer and drill["metrics"] == "amax,scale,overflow,underflow,nonfinite,sqnr"
    k = int(layer.split(".")[1])
    amax_lines = page.evaluate(
        "document.getElementById('drilldown-plot').data"
        ".filter(t => t.mode === 'lines' && t.yaxis === 'y').map(t => t.y)"
    )
    np.testing.assert_array_equal(np.array(amax_lines), stats["amax"][:STEPS, 3 * k : 3 * k + 3].T)

    # a live step: one request, of the buckets after those held only; merged, the cells are all posted
    mark = len(requests.sent)
    post_steps(server.url, run["id"], "b", STEPS, {k: v[STEPS:] for k, v in stats.items()})
    page.wait_for_function(
        "n => document.getElementById('heatmap').data[0].z[0].length === n", arg=STEPS + 4, timeout=20_000
    )
    (live,) = requests.since(mark)
    assert live["after_step"] == str(STEPS - 1) and live["bucket_width"] == "1"
    assert live["metrics"] == "amax,nonfinite"
    z = np.array(drawn_z(page), dtype=float)
    np.testing.assert_allclose(z, np.log2(stats["amax"].T), rtol=1e-15)
    no_page_errors(page)
