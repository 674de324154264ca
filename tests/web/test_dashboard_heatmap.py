"""The run page's heatmap: rows per tensor grouped by layer, buckets as the API plans them, NaN cells in
their own colour, zoom refetching finer buckets, collapsing and filtering; and the curves."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.http import loopback
from tests.support.server import API
from tests.web.browser import no_page_errors, open_run
from tests.web.dashboard_data import create_run, post_steps, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

N_LAYERS = 4
STEPS = 3000
NAN_STEP, NAN_TENSOR = 1234, 4  # blocks.1.mlp.fc.weight
SATURATED_STEP = 2000
SATURATED = "saturated (values lost at the FP8 max)"  # the headroom view's marker of saturated cells


def heatmap_state(page) -> dict:
    """The drawn heatmap: the colour matrix, its grid, and the marker traces of non-finite cells."""
    return page.evaluate(
        """() => {
        const gd = document.getElementById('heatmap');
        const [main, ...rest] = gd.data;
        const markers = {};
        for (const t of rest.filter(t => t.type === 'scatter'))
            markers[t.name] = {colour: t.marker.color, cells: t.customdata || []};
        return {rows: main.z.length, cols: main.z[0].length, x0: main.x0, dx: main.dx, z: main.z,
                ticktext: gd.layout.yaxis.ticktext, markers, colorscale: gd._fullData[0].colorscale,
                info: document.getElementById('heatmap-info').textContent};
    }"""
    )


def test_heatmap_tensors_buckets_nan_zoom(server, page):
    run = create_run(server.url, "heatmap-run", N_LAYERS)
    stats = smooth_stats(STEPS, 3 * N_LAYERS)
    stats["amax"][NAN_STEP, NAN_TENSOR] = np.nan
    stats["nonfinite"][NAN_STEP, NAN_TENSOR] = 3
    stats["amax"][SATURATED_STEP, 0] *= 1000.0  # amax * scale far above 448: headroom < 0
    for first in range(0, STEPS, 1000):
        part = {k: v[first : first + 1000] for k, v in stats.items()}
        post_steps(server.url, run["id"], f"b{first}", first, part)

    open_run(page, server.url, run["id"], stream=False)
    state = heatmap_state(page)
    # one row per tensor, grouped by layer with input, weight, grad_output inside each
    assert state["rows"] == 3 * N_LAYERS
    # twelve rows fit in the scroll box: the plot's own step axis is in sight, so no second one below it
    assert page.eval_on_selector("#heatmap-axis", "a => a.hidden && a.getBoundingClientRect().height === 0")
    assert state["ticktext"][:3] == [
        "blocks.0.mlp.fc.input",
        "blocks.0.mlp.fc.weight",
        "blocks.0.mlp.fc.grad_output",
    ]
    # the columns are the server's buckets for the plot's width
    # at most one column per pixel of the drawn cells
    query = page.evaluate("window.fp8scope.heatmapQuery")
    width = page.evaluate("() => Number(document.querySelector('#heatmap .nsewdrag').getAttribute('width'))")
    assert query["metric"] == "amax" and 0.9 * width <= query["max_cols"] <= width
    api = loopback.get(
        f"{server.url}{API}/runs/{run['id']}/heatmap", params={"max_cols": query["max_cols"]}
    ).json()
    assert state["cols"] == len(api["bucket_start"]) and state["cols"] > 100
    width = api["bucket_width"]
    assert state["dx"] == width and state["x0"] == api["bucket_start"][0] + width / 2
    # the NaN cell: no colour from the scale, a marker of its own colour (in the legend) instead, only there
    col = next(
        i
        for i, (s, e) in enumerate(zip(api["bucket_start"], api["bucket_end"], strict=True))
        if s <= NAN_STEP <= e
    )
    row = state["ticktext"].index("blocks.1.mlp.fc.weight")
    assert state["markers"]["NaN"]["cells"] == [[row, col]]
    assert state["markers"]["+Inf"]["cells"] == [] and state["markers"]["-Inf"]["cells"] == []
    assert state["z"][row][col] is None
    assert sum(v is None for line in state["z"] for v in line) == 1
    nan_colour = state["markers"]["NaN"]["colour"]
    assert (
        nan_colour not in {c for _, c in state["colorscale"]}
        and len({m["colour"] for m in state["markers"].values()}) == 3
    )
    legend = page.eval_on_selector_all("#heatmap .legendtext", "ts => ts.map(t => t.textContent)")
    assert legend == ["NaN", "+Inf", "-Inf"]
    assert "NaN present" in state["info"]

    # zoom on the steps around the NaN: the page asks for that range and gets finer buckets
    wide_width = api["bucket_width"]
    assert wide_width > 1
    page.evaluate(
        "([a, b]) => Plotly.relayout(document.getElementById('heatmap'),"
        " {'xaxis.range[0]': a, 'xaxis.range[1]': b})",
        [NAN_STEP - 100, NAN_STEP + 100],
    )
    page.wait_for_function(
        "() => document.getElementById('heatmap-info').textContent.includes('buckets of 1 step ')"
    )
    zoomed = heatmap_state(page)
    assert zoomed["x0"] == NAN_STEP - 100 + 0.5 and zoomed["dx"] == 1 and zoomed["cols"] == 200
    assert zoomed["markers"]["NaN"]["cells"] == [[row, 100]]

    # 500-tensor usability: filter by name, collapse layers into one row each (NaN propagates)
    page.fill("#heatmap-search", "blocks.2.")
    page.wait_for_function("() => document.getElementById('heatmap').data[0].z.length === 3")
    page.fill("#heatmap-search", "")
    page.click("#heatmap-collapse")
    page.wait_for_function(f"() => document.getElementById('heatmap').data[0].z.length === {N_LAYERS}")
    collapsed = heatmap_state(page)
    assert collapsed["markers"]["NaN"]["cells"] == [[1, 100]]

    # headroom: the saturated cell gets its own marker colour, the NaN stays NaN
    page.click("#heatmap-expand")
    page.click("#heatmap-reset")
    page.select_option("#heatmap-metric", "headroom")
    page.wait_for_function(
        "name => document.getElementById('heatmap').data.some(t => t.name === name)", arg=SATURATED
    )
    head = heatmap_state(page)
    sat_col = SATURATED_STEP // head["dx"] - (head["x0"] - head["dx"] / 2) // head["dx"]
    assert head["markers"][SATURATED]["cells"] == [[0, sat_col]]
    assert head["markers"]["NaN"]["cells"] == [[row, col]]
    assert len({m["colour"] for m in head["markers"].values()}) == 4

    # a layer's drill-down: amax, scale, overflow, underflow and non-finite lines of its three tensors
    page.click("#layers-table tr:has(td.name:text-is('blocks.1.mlp.fc'))")
    page.wait_for_selector("#drilldown-plot .main-svg")
    lines = page.evaluate(
        "document.getElementById('drilldown-plot').data.filter(t => t.mode === 'lines').map(t => t.yaxis)"
    )
    assert sorted(lines) == sorted(["y", "y2", "y3", "y4", "y5"] * 3)
    # its weight's NaN: one band over the bucket that holds it, one marker named in the hover
    drill = page.evaluate(
        "(() => { const gd = document.getElementById('drilldown-plot');"
        " return {bands: gd.layout.shapes.map(s => [s.x0, s.x1]),"
        " text: gd.data.find(t => t.name === 'non-finite elements').text}; })()"
    )
    assert len(drill["bands"]) == 1 and drill["bands"][0][0] < NAN_STEP < drill["bands"][0][1], drill
    assert len(drill["text"]) == 1
    assert drill["text"][0].startswith("blocks.1.mlp.fc.weight: non-finite elements ")
    no_page_errors(page)


def test_run_without_steps_and_unknown_run(server, page):
    run = create_run(server.url, "no-steps-yet", 2)
    open_run(page, server.url, run["id"], stream=False)
    assert page.text_content("#run-last-step") == "–"
    assert page.text_content("#heatmap-info").startswith("6 rows × 0 buckets")
    no_page_errors(page)
    page.goto(f"{server.url}/#/runs/987654")
    page.wait_for_selector("#app p.error")
    assert "run 987654 not found" in page.text_content("#app p.error")


def test_step_axis_stays_in_sight_with_hundreds_of_rows(server, page):
    layers = 100  # 300 rows: the plot is far taller than its scroll box
    run = create_run(server.url, "tall-heatmap", layers)
    post_steps(server.url, run["id"], "a", 0, smooth_stats(400, 3 * layers))
    open_run(page, server.url, run["id"], stream=False)
    page.wait_for_function("() => document.querySelectorAll('#heatmap-axis .tick').length > 2")

    def axis_view() -> dict:
        return page.evaluate(
            """() => {
            const box = document.querySelector('.heatmap-scroll').getBoundingClientRect();
            const axis = document.getElementById('heatmap-axis').getBoundingClientRect();
            const gd = document.getElementById('heatmap');
            const plotTicks = gd._fullLayout.xaxis._vals.map(t => t.text);
            const ticks = [...document.querySelectorAll('#heatmap-axis .tick')].map(t => t.textContent);
            return {boxTop: box.top, boxBottom: box.bottom, axisTop: axis.top, axisBottom: axis.bottom,
                    plotHeight: gd.getBoundingClientRect().height, ticks, plotTicks};
        }"""
        )

    for scroll in ("0", "el.scrollHeight / 2", "el.scrollHeight"):
        page.evaluate(
            f"() => {{ const el = document.querySelector('.heatmap-scroll'); el.scrollTop = {scroll}; }}"
        )
        view = axis_view()
        assert view["plotHeight"] > view["boxBottom"] - view["boxTop"] + 200  # taller than its box
        # the strip is inside the visible part of the scroll box, at its bottom, wherever it is scrolled
        assert view["boxTop"] < view["axisTop"] and view["axisBottom"] <= view["boxBottom"] + 1, (
            scroll,
            view,
        )
        assert view["ticks"] == view["plotTicks"] and "0" in view["ticks"]
    no_page_errors(page)


def test_cells_of_tensors_with_non_finite_elements_are_marked_in_every_view(server, page):
    # as the kernels report them: an amax ignores NaN, so a tensor with a few NaN elements keeps a normal
    # amax and one gone all NaN reports 0, which the service stores as NaN (no amax); the nonfinite count is
    # what says so, and the heatmap marks those cells whatever metric it shows
    steps, t_few, t_all = 60, 4, 7
    run = create_run(server.url, "nonfinite-cells", N_LAYERS)
    stats = smooth_stats(steps, 3 * N_LAYERS)
    stats["nonfinite"][30, t_few] = 5
    stats["nonfinite"][40:45, t_all] = 4096
    stats["amax"][40:45, t_all] = 0.0
    post_steps(server.url, run["id"], "a", 0, stats)
    open_run(page, server.url, run["id"], stream=False)
    page.wait_for_function(
        "() => document.getElementById('heatmap').data.some(t => t.name === 'non-finite elements')"
    )
    state = heatmap_state(page)
    assert state["dx"] == 1 and state["cols"] == steps  # a bucket per step
    rows = {name: i for i, name in enumerate(state["ticktext"])}
    few, gone = rows["blocks.1.mlp.fc.weight"], rows["blocks.2.mlp.fc.weight"]
    marked = sorted(tuple(cell) for cell in state["markers"]["non-finite elements"]["cells"])
    assert marked == [(few, 30)], marked
    assert state["z"][few][30] is not None  # the amax still shows under its mark
    # the tensor gone all NaN has no amax: its cells are NaN's, not an empty amax of 0
    nan_cells = sorted(tuple(cell) for cell in state["markers"]["NaN"]["cells"])
    assert nan_cells == [(gone, c) for c in range(40, 45)], nan_cells
    assert "NaN present" in state["info"] and "non-finite elements present" in state["info"]
    # another metric: the same cells
    page.select_option("#heatmap-metric", "underflow")
    page.wait_for_function(
        "() => document.getElementById('heatmap').data.some(t => t.name === 'non-finite elements'"
        " && (t.customdata || []).length === 6)"
    )
    # the nonfinite view colours the counts themselves: no marks
    page.select_option("#heatmap-metric", "nonfinite")
    page.wait_for_function(
        "() => window.fp8scope.heatmapQuery.metric === 'nonfinite' && "
        "!document.getElementById('heatmap').data.some(t => t.name === 'non-finite elements')"
    )
    no_page_errors(page)


def test_headroom_marks_saturation_not_rounding_to_the_max(server, page):
    # delayed scaling with margin 0 puts amax * scale at the FP8 max whenever the amax repeats its history
    # maximum, a little above it when the amax creeps up: that rounds to the max and loses nothing. Only
    # beyond each format's rounding limit (464 in e4m3, 61440 in e5m2) were values lost
    steps = 10
    run = create_run(server.url, "headroom-limits", 1)  # input and weight e4m3, grad_output e5m2 (HYBRID)
    stats = smooth_stats(steps, 3)
    stats["scale"][:] = 1.0
    stats["amax"][:] = [224.0, 224.0, 28672.0]  # one binade of headroom each
    stats["amax"][2, 0] = 448.0 * 2**0.03  # e4m3: rounds to 448, nothing lost
    stats["amax"][5, 0] = 448.0 * 2**0.08  # e4m3: beyond 464, saturated
    stats["amax"][3, 2] = 57344.0 * 2**0.08  # e5m2: below 61440, nothing lost
    stats["amax"][6, 2] = 57344.0 * 2**0.15  # e5m2: saturated
    stats["amax"][7, 1] = 0.0  # nothing to saturate: no colour, and not "+Inf"
    post_steps(server.url, run["id"], "a", 0, stats)
    page.goto(f"{server.url}/#/runs/{run['id']}?metric=headroom")
    page.wait_for_function("() => window.fp8scope.drawn.heatmap !== undefined")
    page.wait_for_function("() => window.fp8scope.heatmapQuery.metric === 'headroom'")
    page.wait_for_selector("#run-verdict[data-kind]")  # the line above the plots complete: they stay put
    state = heatmap_state(page)
    assert state["dx"] == 1 and state["x0"] == 0.5  # a bucket per step from step 0: column c is step c
    assert sorted(map(tuple, state["markers"][SATURATED]["cells"])) == [
        (0, 5),
        (2, 6),
    ]
    assert state["markers"]["+Inf"]["cells"] == [] and state["z"][1][7] is None
    assert state["z"][0][2] == pytest.approx(-0.03) and state["z"][2][3] == pytest.approx(-0.08)
    # the colours span at least -1 to 4 binades, whatever narrower range the data has (current scaling's
    # headrooms are all 0 up to rounding: fitted, that noise would fill the whole colour scale)
    zrange = page.evaluate(
        "(() => { const t = document.getElementById('heatmap').data[0]; return [t.zmin, t.zmax]; })()"
    )
    assert zrange == [-1, 4], zrange
    # hovering the empty cell says why it is empty
    x, y = page.evaluate(
        """([c, r]) => { const gd = document.getElementById('heatmap'); const L = gd._fullLayout;
        const box = gd.querySelector('.nsewdrag').getBoundingClientRect(); const t = gd.data[0];
        return [box.x + L.xaxis.l2p(t.x0 + c * t.dx), box.y + L.yaxis.l2p(r)]; }""",
        [7, 1],
    )
    page.mouse.move(x - 1, y)
    page.mouse.move(x, y)
    page.wait_for_selector("#tooltip:not([hidden])")
    assert "headroom +Inf (amax 0: nothing to saturate)" in page.text_content("#tooltip")
    # a collapsed layer: each tensor against its own format (the e5m2 tensor's -0.08 is no saturation)
    page.click("#heatmap-collapse")
    page.wait_for_function("() => document.getElementById('heatmap').data[0].z.length === 1")
    collapsed = heatmap_state(page)
    assert sorted(map(tuple, collapsed["markers"][SATURATED]["cells"])) == [
        (0, 5),
        (0, 6),
    ]
    no_page_errors(page)
