"""The quantization-quality metrics on the run page: the heatmap switched to SQNR draws each bucket's worst
SQNR (the known dip of one tensor, in the scale's low, red end), hovering that cell says its value in dB,
the first frame (canvas, before plotly.js) draws the same colours, and the layers table has an SQNR column,
blank for a run without the quality statistics."""

from __future__ import annotations

import numpy as np
import pytest

from fp8_protocol.stats import BASE_COLUMNS, QUALITY_COLUMNS
from tests.support.http import loopback
from tests.support.server import API, col
from tests.web.browser import PlotlyGate, no_page_errors, wait_drawn
from tests.web.dashboard_data import create_run, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

N_LAYERS = 4
STEPS = 300
DIP_STEP, DIP_TENSOR, DIP_DB = 171, 6, 7.5  # blocks.2.mlp.fc.input: row 6 when grouped by layer
LOW, HIGH = "#a50026", "#006837"  # the SQNR scale's ends: worst (red) and best (green)


def quality_stats(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    stats = smooth_stats(STEPS, 3 * N_LAYERS, seed=seed)
    sum_sq = (stats["amax"] / rng.uniform(5.0, 50.0, size=stats["amax"].shape)) ** 2 * stats["numel"]
    sqnr = rng.uniform(25.0, 35.0, size=(1, 3 * N_LAYERS)) + rng.normal(0.0, 1.0, size=sum_sq.shape)
    sqnr[DIP_STEP, DIP_TENSOR] = DIP_DB
    return stats | {
        "sum_sq": sum_sq,
        "err_sq": sum_sq * 10.0 ** (-sqnr / 10.0),
        "subnormal": rng.poisson(10.0, size=sum_sq.shape).astype(np.float64),
        "min_abs": stats["amax"] * 2.0 ** -rng.uniform(8.0, 16.0, size=sum_sq.shape),
    }


def post_run(server, name: str, stats: dict[str, np.ndarray], quality: bool) -> dict:
    run = create_run(server.url, name, N_LAYERS)
    names = (*BASE_COLUMNS, *QUALITY_COLUMNS) if quality else BASE_COLUMNS
    steps = [
        {
            "step": s,
            "scalars": {"loss": 3.0, "grad_norm": 1.0},
            "stats": {n: col(stats[n][s], "float64") for n in names},
        }
        for s in range(STEPS)
    ]
    r = loopback.post(
        f"{server.url}{API}/runs/{run['id']}/telemetry",
        json={"idempotency_key": "all", "steps": steps},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return run


def sqnr_of(stats: dict[str, np.ndarray]) -> np.ndarray:
    return 10.0 * np.log10(stats["sum_sq"] / stats["err_sq"])


PIXELS_OF = """([id, colour]) => {
    const c = document.getElementById(id);
    const {data} = c.getContext('2d').getImageData(0, 0, c.width, c.height);
    const scale = c.width / c.getBoundingClientRect().width;
    const out = [];
    for (let y = 0; y < c.height; y++) for (let x = 0; x < c.width; x++) {
        const o = (y * c.width + x) * 4;
        if (data[o + 3] === 0) continue;
        const key = '#' + [0, 1, 2].map(i => data[o + i].toString(16).padStart(2, '0')).join('');
        if (key === colour) out.push([x / scale, y / scale]);
    }
    const box = c.getBoundingClientRect();
    return {pixels: out, width: box.width, height: box.height};
}"""


def test_sqnr_heatmap_hover_first_frame_and_layers_column(server, page):
    stats = quality_stats()
    run = post_run(server, "quality-run", stats, quality=True)
    sqnr = sqnr_of(stats)

    # the page opened on the SQNR heatmap: its first frame, before plotly.js, in the SQNR colours
    plotly = PlotlyGate(page)  # plotly.js waits until the test lets it through
    page.goto(f"{server.url}/#/runs/{run['id']}?metric=sqnr")
    page.wait_for_function("() => window.fp8scope.painted.heatmap !== undefined")
    assert page.evaluate("window.Plotly") is None and plotly.held
    low = page.evaluate(PIXELS_OF, ["heatmap-preview", LOW])
    row_h = (low["height"] - 50) / (3 * N_LAYERS)  # cells from y=10 to height-40, one row per tensor
    assert low["pixels"], "the worst cell is not drawn in the scale's low end"
    assert {int((y - 10) // row_h) for _, y in low["pixels"]} == {DIP_TENSOR}
    cells_w = low["width"] - 230 - 20 - 90  # the plot's margins and colour bar
    assert {int((x - 230) * STEPS // cells_w) for x, _ in low["pixels"]} <= {
        DIP_STEP - 1,
        DIP_STEP,
        DIP_STEP + 1,
    }
    best = np.unravel_index(np.argmax(sqnr), sqnr.shape)
    high = page.evaluate(PIXELS_OF, ["heatmap-preview", HIGH])
    assert {int((y - 10) // row_h) for _, y in high["pixels"]} == {int(best[1])}
    plotly.release()

    # plotly's heatmap: the same bucket layout as the API, the same colour scale, the dip in its cell
    wait_drawn(page, "heatmap", "curves")
    assert page.eval_on_selector("#heatmap-metric", "s => s.value") == "sqnr"
    query = page.evaluate("window.fp8scope.heatmapQuery")
    assert query["metric"] == "sqnr"
    params = {k: v for k, v in query.items() if v is not None}
    api = loopback.get(f"{server.url}{API}/runs/{run['id']}/heatmap", params=params).json()
    assert api["aggregation"] == "min" and api["bucket_width"] == 1
    drawn = page.evaluate(
        """() => { const gd = document.getElementById('heatmap'); const t = gd.data[0];
        return {z: t.z, x0: t.x0, dx: t.dx, scale: t.colorscale, title: gd._fullData[0].colorbar.title.text,
                ticks: gd.layout.yaxis.ticktext}; }"""
    )
    assert drawn["title"] == "SQNR (dB)" and drawn["scale"][0] == [0, LOW] and drawn["scale"][-1] == [1, HIGH]
    assert drawn["ticks"][DIP_TENSOR] == "blocks.2.mlp.fc.input"
    c = api["bucket_start"].index(DIP_STEP)
    z = np.array(drawn["z"], dtype=np.float64)
    np.testing.assert_allclose(z, sqnr.T, rtol=1e-12)  # one step per bucket: every cell is its step's SQNR
    assert z[DIP_TENSOR, c] == pytest.approx(DIP_DB, abs=1e-9) and z.min() == z[DIP_TENSOR, c]

    # hovering the dip's cell says its value in dB
    page.locator("#heatmap").scroll_into_view_if_needed()
    x, y = page.evaluate(
        """([c, r]) => { const gd = document.getElementById('heatmap'); const L = gd._fullLayout;
        const box = gd.querySelector('.nsewdrag').getBoundingClientRect(); const t = gd.data[0];
        return [box.x + L.xaxis.l2p(t.x0 + c * t.dx), box.y + L.yaxis.l2p(r)]; }""",
        [c, DIP_TENSOR],
    )
    page.mouse.move(x - 1, y)
    page.mouse.move(x, y)
    page.wait_for_selector("#tooltip:not([hidden])")
    tip = page.text_content("#tooltip")
    assert "blocks.2.mlp.fc.input" in tip and f"steps{DIP_STEP}–{DIP_STEP}" in tip.replace(" ", "")
    assert "sqnr 7.5 dB" in tip

    # the layers table: each layer's worst latest SQNR, to one decimal
    page.wait_for_selector("#layers-table tbody tr td.sqnr")
    rows = page.eval_on_selector_all(
        "#layers-table tbody tr", "rs => rs.map(r => [r.cells[0].textContent, r.cells[2].textContent])"
    )
    header = page.eval_on_selector_all("#layers-table thead th", "ths => ths.map(t => t.textContent)")
    assert header == ["Layer", "Severity", "SQNR (dB)", "Block range", "Reasons"]
    expected = {f"blocks.{k}.mlp.fc": f"{sqnr[-1, 3 * k : 3 * k + 3].min():.1f}" for k in range(N_LAYERS)}
    assert dict(rows) == expected
    # the layer's drill-down adds an SQNR panel: the dip's tensor reaches its 7.5 dB at its step
    page.click("#layers-table tr:has(td.name:text-is('blocks.2.mlp.fc'))")
    page.wait_for_selector("#drilldown-plot .main-svg")
    drill = page.evaluate(
        """() => { const gd = document.getElementById('drilldown-plot');
        const axis = Object.keys(gd.layout).find(k => k.startsWith('yaxis')
            && gd.layout[k].title.text === 'SQNR (dB)').replace('axis', '');
        const t = gd.data.find(t => t.yaxis === axis && t.name === 'input');
        return {x: t.x, y: t.y}; }"""
    )
    low = int(np.nanargmin(np.array(drill["y"], dtype=np.float64)))
    assert drill["x"][low] == DIP_STEP and drill["y"][low] == pytest.approx(DIP_DB, abs=1e-9), drill

    # the other quality metrics: their colour bars, and cells that are the API's values as the legend says
    # (subnormal in percent, outlier ratio in log10)
    shown = {
        "subnormal": ("% subnormal", lambda v: 100.0 * v),
        "dynamic_range": ("binades", lambda v: v),
        "outlier_ratio": ("log10(amax/RMS)", np.log10),
    }
    for metric, (title, colour_of) in shown.items():
        page.select_option("#heatmap-metric", metric)
        page.wait_for_function(
            "t => document.getElementById('heatmap').data[0].colorbar.title.text === t", arg=title
        )
        query = {k: v for k, v in page.evaluate("window.fp8scope.heatmapQuery").items() if v is not None}
        api = loopback.get(f"{server.url}{API}/runs/{run['id']}/heatmap", params=query).json()
        assert api["metric"] == metric and api["aggregation"] == "max"
        z = np.array(page.evaluate("document.getElementById('heatmap').data[0].z"), dtype=np.float64)
        np.testing.assert_allclose(z, colour_of(np.array(api["values"], dtype=np.float64)), rtol=1e-12)
    no_page_errors(page)


def test_a_run_without_quality_statistics_shows_a_blank_sqnr(server, page):
    run = post_run(server, "no-quality-run", smooth_stats(STEPS, 3 * N_LAYERS, seed=1), quality=False)
    page.goto(f"{server.url}/#/runs/{run['id']}")
    wait_drawn(page, "heatmap", "curves")
    page.wait_for_selector("#layers-table tbody tr td.sqnr")
    cells = page.eval_on_selector_all("#layers-table tbody tr", "rs => rs.map(r => r.cells[2].textContent)")
    assert cells == [""] * N_LAYERS
    # the SQNR heatmap of such a run: buckets without data, nothing coloured
    page.select_option("#heatmap-metric", "sqnr")
    page.wait_for_function(
        "() => document.getElementById('heatmap').data[0].colorbar.title.text === 'SQNR (dB)'"
    )
    z = page.evaluate("document.getElementById('heatmap').data[0].z")
    assert len(z) == 3 * N_LAYERS and all(v is None for row in z for v in row)
    # its drill-down: no SQNR panel for SQNR it never sent
    page.click("#layers-table tr:has(td.name:text-is('blocks.1.mlp.fc'))")
    page.wait_for_selector("#drilldown-plot .main-svg")
    titles = page.evaluate(
        "(() => { const l = document.getElementById('drilldown-plot').layout;"
        " return Object.keys(l).filter(k => k.startsWith('yaxis')).map(k => l[k].title.text); })()"
    )
    assert titles == ["amax", "scale", "overflow", "underflow", "non-finite"], titles
    no_page_errors(page)


def test_the_comparison_takes_the_difference_of_any_metric(server, page):
    # B is A with 6 dB less SQNR everywhere (err_sq x 10**0.6) and 4x the overflow counts
    a_stats = quality_stats(seed=4)
    a_stats["overflow"] = np.full_like(a_stats["amax"], 9.0)
    b_stats = {k: v.copy() for k, v in a_stats.items()}
    b_stats["err_sq"] *= 10.0**0.6
    b_stats["overflow"] = np.full_like(a_stats["amax"], 39.0)
    run_a, run_b = post_run(server, "diff-a", a_stats, True), post_run(server, "diff-b", b_stats, True)
    page.goto(f"{server.url}/#/compare?runs={run_a['id']},{run_b['id']}&metric=sqnr")
    page.wait_for_function("() => window.fp8scope.drawn.compare !== undefined")
    assert page.text_content("#compare-diff-title").startswith("Heatmap difference: SQNR(A) − SQNR(B), dB")
    assert page.input_value("#compare-metric") == "sqnr"

    def values() -> list[float]:
        z = page.evaluate("document.getElementById('compare-diff').data[0].z")
        return [v for row in z for v in row if v is not None]

    got = values()
    assert len(got) == 3 * N_LAYERS * STEPS and all(v == pytest.approx(6.0, abs=1e-9) for v in got)
    # per layer and role, in numbers: the mean over the buckets
    table = page.eval_on_selector_all(
        "#compare-diff-layers tbody tr", "trs => trs.map(tr => [...tr.cells].map(c => c.textContent))"
    )
    assert table == [[f"blocks.{k}.mlp.fc", "+6.00", "+6.00", "+6.00"] for k in range(N_LAYERS)], table
    # another metric from the picker: the address keeps it, the pair stays
    page.evaluate("window.fp8scope.drawn.compare = undefined")
    page.select_option("#compare-metric", "overflow")
    page.wait_for_function("() => location.hash.includes('metric=overflow')")
    page.wait_for_function("() => window.fp8scope.drawn.compare !== undefined")
    assert f"a={run_a['id']}" in page.evaluate("location.hash")
    got = values()
    want = np.log10(1 + 9.0) - np.log10(1 + 39.0)  # log10(1 + count), A - B
    assert len(got) == 3 * N_LAYERS * STEPS and all(v == pytest.approx(want, abs=1e-9) for v in got)
    # against a run sent without the quality columns: nothing to subtract, and the page says why
    bare = post_run(server, "diff-bare", smooth_stats(STEPS, 3 * N_LAYERS, seed=2), quality=False)
    page.evaluate("window.fp8scope.drawn.compare = undefined")
    page.goto(f"{server.url}/#/compare?runs={run_a['id']},{bare['id']}&metric=sqnr")
    page.wait_for_function("() => window.fp8scope.drawn.compare !== undefined")
    assert values() == []
    cells = page.eval_on_selector_all(
        "#compare-diff-layers tbody td.num", "tds => tds.map(td => td.textContent)"
    )
    assert cells == ["–"] * 3 * N_LAYERS
    info = page.text_content("#compare-diff-info")
    assert info.endswith(f"; no sqnr values stored for #{bare['id']} in these steps"), info
    no_page_errors(page)
