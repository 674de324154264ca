"""Post-mortem of a crashed run: the first non-finite (step, tensor) highlighted, a timeline before each loss
spike (from the flight recorder when the event carries one, else from the stored series), and the
comparison of two runs (loss overlay, log2 amax difference)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.http import loopback
from tests.support.server import API
from tests.web.browser import no_page_errors, open_run
from tests.web.dashboard_data import create_run, post_steps, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

STEPS = 200
FIRST_BAD = (150, 7)  # blocks.2.mlp.fc.weight
LATER_BAD = (160, 1)


def test_postmortem_and_comparison(server, page):
    run = create_run(server.url, "crashed-run", 3)
    twin = create_run(server.url, "twin-run", 3)
    stats = smooth_stats(STEPS, 9, seed=5)
    twin_stats = {k: v.copy() for k, v in stats.items()}
    twin_stats["amax"] *= 2.0  # every amax one binade higher in the twin
    for step, t in (FIRST_BAD, LATER_BAD):
        stats["amax"][step, t] = np.nan
        stats["nonfinite"][step, t] = 4
    flight = [
        {"step": s, "loss": 2.0 + (s == 100) * 5.0, "grad_norm": 1.0, "tokens_per_s": 12000.0 + s,
         "overflow": 2000 * (s == 100)}
        for s in range(85, 101)
    ]  # fmt: skip
    events = [
        {
            "kind": "loss_spike",
            "step": 100,
            # a real recorder's histograms make it tens of kB: listed as a summary, fetched whole
            "details": {"last_steps": flight, "histograms": {"blocks.0.mlp.fc.weight": list(range(2000))}},
        },
        {"kind": "loss_spike", "step": 180, "details": {}},
    ]
    losses = np.full(STEPS, 2.0)
    losses[165:168] = np.nan  # three non-finite losses in a row, then one alone
    losses[190] = np.inf
    post_steps(server.url, run["id"], "a", 0, stats, losses=losses, events=events)
    post_steps(server.url, twin["id"], "a", 0, twin_stats, losses=losses + 0.5)
    assert (
        loopback.patch(f"{server.url}{API}/runs/{run['id']}", json={"status": "crashed"}).status_code == 200
    )

    open_run(page, server.url, run["id"], stream=False)
    # the first non-finite value, named, and outlined on the heatmap
    page.wait_for_selector("#first-nonfinite")
    assert page.text_content("#first-nonfinite .name") == "blocks.2.mlp.fc.weight"
    assert "at step 150" in page.text_content("#first-nonfinite")
    # how it ended: the verdict's line under the header, red
    page.wait_for_selector("#run-verdict .verdict-head")
    assert page.text_content("#run-verdict .verdict-head").startswith("Crashed at step")
    assert page.get_attribute("#run-verdict", "data-kind") == "bad"
    page.click("#show-first-nonfinite")
    page.wait_for_function(
        "() => document.getElementById('heatmap-info').textContent.includes('buckets of 1 step ')"
    )
    shape = page.evaluate("document.getElementById('heatmap').layout.shapes[0]")
    ticks = page.evaluate("document.getElementById('heatmap').layout.yaxis.ticktext")
    assert shape["x0"] == 150 and shape["x1"] == 151
    assert ticks[round(shape["y0"] + 0.5)] == "blocks.2.mlp.fc.weight"

    # a timeline per spike: the flight recorder's 16 steps, and the stored series where there is none
    page.wait_for_selector("#postmortem .timeline[data-step='100'][data-points]")
    page.wait_for_selector("#postmortem .timeline[data-step='180'][data-points]")
    assert page.get_attribute("#postmortem .timeline[data-step='100']", "data-points") == "16"
    assert "flight recorder" in page.text_content("#postmortem .timeline[data-step='100']")
    assert page.get_attribute("#postmortem .timeline[data-step='180']", "data-points") == str(180 - 116 + 1)
    assert "stored series" in page.text_content("#postmortem .timeline[data-step='180']")
    # each series of the recorder in a strip of its own (units differ by orders of magnitude), named in
    # it, the strips apart, no legend over the plot; the spike marked on the loss
    plot = "#postmortem .timeline[data-step='100'] .timeline-plot"
    drawn = page.evaluate(
        f"""(() => {{ const p = document.querySelector("{plot}");
        const axes = Object.keys(p.layout).filter(k => /^yaxis[0-9]*$/.test(k));
        return {{traces: p.data.map(t => [t.name, t.yaxis]), legend: p.layout.showlegend,
                 domains: Object.fromEntries(axes.map(k => ["y" + k.slice(5), p.layout[k].domain])),
                 labels: p.layout.annotations.map(a => a.text)}}; }})()"""
    )
    series = [t for t in drawn["traces"] if t[0] != "spike"]
    assert [name for name, _ in series] == ["loss", "grad_norm", "tokens_per_s", "overflow"], drawn
    assert drawn["labels"] == ["loss", "grad_norm", "tokens_per_s", "overflow"] and drawn["legend"] is False
    assert len({axis for _, axis in series}) == 4 and ["spike", "y"] in drawn["traces"], drawn
    spans = sorted(drawn["domains"][axis] for _, axis in series)
    assert all(lo < hi <= nxt_lo for (lo, hi), (nxt_lo, _) in zip(spans, spans[1:], strict=False)), spans
    assert page.locator(f"{plot} g.legend").count() == 0
    # spike markers on the loss curve
    spikes = page.evaluate("document.getElementById('curves').data.find(t => t.name === 'loss spike').x")
    assert sorted(spikes) == [100, 180]
    # each run of non-finite losses one band, named in its hover (not a dashed line per step)
    curves = "document.getElementById('curves')"
    bands = page.evaluate(f"{curves}.layout.shapes.filter(s => s.type === 'rect').map(s => [s.x0, s.x1])")
    assert bands == [[164.5, 167.5], [189.5, 190.5]], bands
    marks = page.evaluate(f"{curves}.data.find(t => t.name === 'non-finite loss').text")
    assert marks == ["non-finite loss from step 165 to 167", "non-finite loss at step 190"], marks

    # comparison: loss overlay and the amax difference (twin is 2x everywhere -> -1 binade)
    page.goto(f"{server.url}/#/compare?a={run['id']}&b={twin['id']}")
    page.wait_for_function("() => window.fp8scope.drawn.compare !== undefined")
    drawn = page.evaluate(
        "document.getElementById('compare-loss').data"
        ".map(t => [t.mode, t.mode === 'lines' ? t.y[0] : t.text])"
    )
    # both runs' non-finite losses (the twin's are the same steps) named per run, after the two lines
    assert drawn == [
        ["lines", 2.0],
        ["lines", 2.5],
        *[
            ["markers", [f"#{r['id']} {r['name']}: non-finite loss from step 165 to 167",
                         f"#{r['id']} {r['name']}: non-finite loss at step 190"]]
            for r in (run, twin)
        ],
    ], drawn  # fmt: skip
    diff = page.evaluate(
        "(() => { const d = document.getElementById('compare-diff').data;"
        " return {z: d[0].z, s: d[1].z, x0: d[0].x0, dx: d[0].dx}; })()"
    )
    assert len(diff["z"]) == 9 and len(diff["z"][0]) == STEPS and (diff["x0"], diff["dx"]) == (0.5, 1)
    finite = [v for row in diff["z"] for v in row if v is not None]
    assert len(finite) == 9 * STEPS - 2 and all(abs(v + 1.0) < 1e-9 for v in finite)
    flagged = sorted((r, c) for r, row in enumerate(diff["s"]) for c, v in enumerate(row) if v == 1)
    # rows in layer order (input, weight, grad_output): tensor 7 is row 7, tensor 1 is row 1
    assert flagged == [(1, 160), (7, 150)]
    no_page_errors(page)


def test_loss_spike_arriving_live_shows_its_flight_recorder(server, page):
    """A loss spike sent while the run page is open: its big event comes over the stream as a summary, and
    the page fetches the whole event (the flight recorder) by the id the stream names it by."""
    run = create_run(server.url, "live-spike", 2)
    post_steps(server.url, run["id"], "a", 0, smooth_stats(60, 6, seed=3))
    open_run(page, server.url, run["id"])
    flight = [{"step": s, "loss": 2.0 + (s == 60) * 4.0, "grad_norm": 1.0} for s in range(37, 61)]
    details = {"last_steps": flight, "histograms": {"blocks.0.mlp.fc.weight": list(range(2000))}}
    spike = {"kind": "loss_spike", "step": 60, "details": details}
    mark = {"kind": "custom", "step": 60, "details": {"name": "checkpoint"}}
    post_steps(
        server.url,
        run["id"],
        "b",
        60,
        smooth_stats(1, 6, seed=4),
        losses=np.array([6.0]),
        events=[spike, mark],
    )
    box = "#postmortem .timeline[data-step='60']"
    page.wait_for_selector(f"{box}[data-points]")
    assert page.get_attribute(box, "data-points") == str(len(flight))
    assert "flight recorder: 24 steps sent with the event" in page.text_content(box)
    # the events the stream brought are the stored ones: a list loaded meanwhile does not add them twice
    marks = "() => document.getElementById('curves').data.find((t) => t.name === 'events').x"
    page.wait_for_function(f"() => ({marks})().length > 0")
    assert page.evaluate(f"({marks})()") == [60]
    no_page_errors(page)
