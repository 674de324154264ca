"""The run page's first frame: heatmap and curves painted on canvases before plotly.js has loaded (their
cells and lines where plotly puts them), then handed over to plotly's plots of the same size; and the
old path (?paint=plotly), which waits for plotly.js, still drawing the same page."""

from __future__ import annotations

import numpy as np
import pytest

from tests.web.browser import PlotlyGate, no_page_errors, wait_drawn
from tests.web.dashboard_data import create_run, post_steps, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

N_LAYERS = 4
STEPS = 2000
NAN_STEP, NAN_TENSOR = 1234, 4  # blocks.1.mlp.fc.weight: row 4 when grouped by layer

CANVAS_PIXELS = """id => {
    const c = document.getElementById(id);
    const ctx = c.getContext('2d');
    const {data} = ctx.getImageData(0, 0, c.width, c.height);
    const scale = c.width / c.getBoundingClientRect().width;  // device pixels per CSS pixel
    const rows = {};  // colour -> [y] of its pixels (CSS px)
    let painted = 0;
    for (let y = 0; y < c.height; y++) for (let x = 0; x < c.width; x++) {
        const o = (y * c.width + x) * 4;
        if (data[o + 3] === 0) continue;
        painted++;
        const key = '#' + [0, 1, 2].map(i => data[o + i].toString(16).padStart(2, '0')).join('');
        (rows[key] ||= []).push(y / scale);
    }
    const box = c.getBoundingClientRect();
    return {painted, width: box.width, height: box.height, magenta: rows['#ff00ff'] || [],
            loss: (rows['#1f77b4'] || []).length, grad: (rows['#2ca02c'] || []).length,
            viridisDark: (rows['#440154'] || []).length + (rows['#48186a'] || []).length};
}"""


def make_run(server) -> dict:
    run = create_run(server.url, "first-paint-run", N_LAYERS)
    stats = smooth_stats(STEPS, 3 * N_LAYERS)
    stats["amax"][NAN_STEP, NAN_TENSOR] = np.nan
    stats["nonfinite"][NAN_STEP, NAN_TENSOR] = 3
    stats["amax"][:, 0] *= 1e-3  # one row far below the others: the dark end of the colour scale
    post_steps(server.url, run["id"], "b0", 0, stats)
    return run


def test_first_frame_before_plotly_then_hand_over(server, page):
    run = make_run(server)
    plotly = PlotlyGate(page)  # plotly.js waits until the test lets it through
    page.goto(f"{server.url}/#/runs/{run['id']}")
    page.wait_for_function(
        "() => window.fp8scope.painted.heatmap !== undefined && window.fp8scope.painted.curves !== undefined"
    )
    assert page.evaluate("window.Plotly") is None and plotly.held  # painted with plotly.js still on its way
    assert page.evaluate("Object.keys(window.fp8scope.drawn)") == []

    heat = page.evaluate(CANVAS_PIXELS, "heatmap-preview")
    assert heat["painted"] > 1000 and heat["viridisDark"] > 0
    # the NaN cell in its own colour, in its tensor's row (cells from y=10 to height-40, one row per tensor)
    row_h = (heat["height"] - 50) / (3 * N_LAYERS)
    assert heat["magenta"], "the NaN cell is not drawn"
    rows = {int((y - 10) // row_h) for y in heat["magenta"]}
    assert rows == {NAN_TENSOR}
    curves = page.evaluate(CANVAS_PIXELS, "curves-preview")
    assert curves["loss"] > 100 and curves["grad"] > 100

    plotly.release()
    wait_drawn(page, "heatmap", "curves")
    # handed over: the canvases are gone, plotly's plots stand where they stood, at the same size
    assert page.evaluate("document.querySelectorAll('canvas.preview').length") == 0
    sizes = page.evaluate(
        "() => ['heatmap', 'curves'].map(id => document.getElementById(id).getBoundingClientRect())"
        ".map(b => [b.width, b.height])"
    )
    assert sizes[0][1] == pytest.approx(heat["height"], abs=1)
    assert sizes[1][1] == pytest.approx(curves["height"], abs=1)
    assert sizes[0][0] == pytest.approx(heat["width"], abs=1)
    times = page.evaluate("[window.fp8scope.painted, window.fp8scope.drawn]")
    for kind in ("heatmap", "curves"):
        assert times[0][kind] < times[1][kind]  # the first frame came before plotly's
    no_page_errors(page)


def test_old_path_waits_for_plotly(server, page):
    run = make_run(server)
    page.goto(f"{server.url}/?paint=plotly#/runs/{run['id']}")
    page.wait_for_function(
        "() => window.fp8scope.painted.heatmap !== undefined && window.fp8scope.painted.curves !== undefined"
    )
    assert page.evaluate("window.fp8scope.preview") is False
    assert page.evaluate("document.querySelectorAll('canvas.preview').length") == 0
    times = page.evaluate("[window.fp8scope.painted, window.fp8scope.drawn]")
    for kind in ("heatmap", "curves"):
        assert times[0][kind] >= times[1][kind]  # painted only once plotly drew it
    no_page_errors(page)
