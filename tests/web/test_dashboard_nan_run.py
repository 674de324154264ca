"""What a user sees of a real run that went NaN: `fp8-train` with a NaN injected into one layer's input,
streamed into the service beside a healthy twin (same seed), then the run page's heatmap, the layer's
drill-down and the comparison with the twin, each asked where the non-finite values began."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.http import loopback
from tests.support.server import API
from tests.web.browser import no_page_errors, open_run
from tests.web.dashboard_data import create_run, post_steps, smooth_stats

pytestmark = pytest.mark.slow  # real trainings, a real browser and server

STEPS, NAN_STEP, LAYER = 16, 9, "blocks.1.mlp.fc"
SATURATED = "saturated (values lost at the FP8 max)"  # the headroom view's marker
TWIN_STEPS = 40  # the healthy twin trains on: long enough for delayed scaling to clip some amax highs
FLAGS = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32"]
FLAGS += ["--eval-interval", "0", "--no-progress", "--log-interval", "1000"]


def train(url: str, name: str, tmp_path, *extra: str, steps: int = STEPS) -> int:
    cmd = [sys.executable, "-m", "fp8_trainer.app.cli", *FLAGS, "--steps", str(steps), "--monitor-url", url]
    cmd += ["--run-name", name, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = loopback.get(f"{url}{API}/runs", params={"q": name}).json()
    return next(r["id"] for r in runs if r["name"] == name)


def marks(page, plot: str, trace: str) -> dict[str, set[int]]:
    """The cells marked by `trace` on heatmap `plot` (one step per bucket): tensor name -> steps."""
    got = page.evaluate(
        """([plot, trace]) => {
        const gd = document.getElementById(plot);
        const t = gd.data.find(t => t.name === trace);
        return {x: t ? t.x : [], y: t ? t.y : [], names: gd.layout.yaxis.ticktext, dx: gd.data[0].dx};
    }""",
        [plot, trace],
    )
    assert got["dx"] == 1 and len(got["names"]) == 48  # every row labelled, a cell is a step
    cells: dict[str, set[int]] = {}
    for x, row in zip(got["x"], got["y"], strict=True):
        if x is not None:
            cells.setdefault(got["names"][row], set()).add(int(x))  # x is the cell's centre, step + 0.5
    return cells


def test_a_real_nan_run_on_the_run_page_the_drill_down_and_the_comparison(server, page, tmp_path):
    twin = train(server.url, "nan-twin-healthy", tmp_path, steps=TWIN_STEPS)
    bad = train(server.url, "nan-twin-poisoned", tmp_path, "--inject", f"nan:{LAYER}@{NAN_STEP}")

    # the run page: the heatmap marks, from the injection on, every tensor with non-finite elements; the
    # first marked cell of the step is the poisoned input, the layers before it in the forward pass clean
    open_run(page, server.url, bad, stream=False)
    # the verdict under the header: the run ended on a NaN loss (not a green "finished"), its incident named
    # with the tensor and step where the NaN began
    page.wait_for_selector("#run-verdict .verdict-item")
    head = page.text_content("#run-verdict .verdict-head")
    assert head.startswith(f"Finished at step {STEPS}, with a NaN loss from step {NAN_STEP} to the end"), head
    assert page.get_attribute("#run-verdict", "data-kind") == "bad"
    assert page.text_content(".run-head .badge.bad") == "finished, loss NaN"
    assert not page.locator(".run-head .badge.ok").count()
    item = page.text_content("#run-verdict .verdict-item")
    assert f"{LAYER}.input at step {NAN_STEP}" in item, item
    # and so says the runs list
    page.goto(f"{server.url}/#/?q=nan-twin-poisoned")
    page.wait_for_function("() => document.querySelectorAll('#runs-table tbody tr').length === 1")
    assert page.text_content("#runs-table tbody tr .badge.bad") == "finished, loss NaN"
    open_run(page, server.url, bad, stream=False)
    # the learning rate is never negative: its axis starts at 0 (autorange pads below the lowest value)
    start = page.evaluate("document.getElementById('curves')._fullLayout.yaxis3.range[0]")
    assert start == 0, start
    page.wait_for_function(
        "() => (document.getElementById('heatmap').data || []).some(t => t.name === 'non-finite elements')"
    )
    assert "non-finite elements present" in page.text_content("#heatmap-info")
    # a cell of a tensor with NaN/Inf elements is marked as such, or, where the tensor is all NaN (it has no
    # amax: NaN), drawn in NaN's colour
    partly, gone = (marks(page, "heatmap", trace) for trace in ("non-finite elements", "NaN"))
    marked = {name: partly.get(name, set()) | gone.get(name, set()) for name in partly.keys() | gone.keys()}
    assert gone and min(min(steps) for steps in marked.values()) == NAN_STEP
    assert NAN_STEP in marked[f"{LAYER}.input"]
    assert NAN_STEP not in marked.get("blocks.0.attn.qkv.input", set())
    assert NAN_STEP not in marked.get("blocks.0.attn.qkv.weight", set())
    # the NaN reached every tensor by the next step and stayed
    assert len(marked) == 48 and all(set(range(NAN_STEP + 1, STEPS + 1)) <= s for s in marked.values())

    # any scalar charted: its non-finite values as a band, named in a marker's hover
    page.check("#scalars-picker label[data-name='loss'] input")
    page.wait_for_function(
        "() => (document.getElementById('scalars-plot').data || []).some(t => t.name === 'loss: non-finite')"
    )
    loss = page.evaluate(
        "(() => { const gd = document.getElementById('scalars-plot');"
        " return {spans: gd.data.find(t => t.name === 'loss: non-finite').meta.spans,"
        " bands: gd.layout.shapes.map(s => [s.x0, s.x1, s.yref])}; })()"
    )
    axis = page.evaluate("document.getElementById('scalars-plot').data.find(t => t.name === 'loss').yaxis")
    assert loss["spans"] == [[NAN_STEP, STEPS]], loss
    assert [NAN_STEP - 0.5, STEPS + 0.5, f"{axis} domain"] in loss["bands"], (loss, axis)

    # the layers table: no SQNR left to show for a layer whose tensors hold nothing finite (its last finite
    # one, a healthy-looking 25 dB, would say the quantization is fine)
    sqnr = page.text_content(f"#layers-table tr:has(td.name:text-is('{LAYER}')) td.sqnr")
    assert sqnr == "NaN", sqnr

    # the layer's drill-down: the counts' panel, and a band from the injection to the end of the run
    page.click(f"#layers-table tr:has(td.name:text-is('{LAYER}'))")
    page.wait_for_selector("#drilldown-plot .main-svg")
    drill = page.evaluate(
        "(() => { const gd = document.getElementById('drilldown-plot');"
        " return {bands: gd.layout.shapes.map(s => [s.x0, s.x1]),"
        " text: gd.data.find(t => t.name === 'non-finite elements').text}; })()"
    )
    assert drill["bands"] == [[NAN_STEP - 0.5, STEPS + 0.5]], drill
    assert f"{LAYER}.input: non-finite elements from step {NAN_STEP} to {STEPS}" in drill["text"]

    # the comparison with the healthy twin: the poisoned run's loss as a band in its colour, the twin's
    # none; the amax difference says where the poisoned run's tensors went non-finite and marks them
    page.goto(f"{server.url}/#/compare?runs={bad},{twin}")
    page.wait_for_function("() => window.fp8scope.drawn.compare !== undefined")
    scalars = page.evaluate(
        "(() => { const gd = document.getElementById('compare-loss');"
        " return {bad: gd.data.filter(t => t.meta && t.meta.spans).map(t => [t.meta.run, t.meta.spans]),"
        " bands: gd.layout.shapes.map(s => [s.x0, s.x1])}; })()"
    )
    assert scalars["bad"] == [[bad, [[NAN_STEP, STEPS]]]], scalars
    assert scalars["bands"] == [[NAN_STEP - 0.5, STEPS + 0.5]]
    info = page.text_content("#compare-diff-info")
    assert info.endswith(f"non-finite elements in #{bad} from step {NAN_STEP}"), info
    # the same cells as on the poisoned run's own page (the twin has none)
    assert marks(page, "compare-diff", "non-finite elements in either") == marked
    no_page_errors(page)

    # the healthy twin's headroom: the cells marked saturated are the cells whose overflow count is not
    # zero (delayed scaling with margin 0 keeps amax * scale at the FP8 max, which rounds and loses nothing)
    page.goto(f"{server.url}/#/runs/{twin}?metric=headroom")
    page.wait_for_function(
        "name => { const gd = document.getElementById('heatmap');"
        " return gd && gd.data && gd.data.some(t => t.name === name); }",
        arg=SATURATED,
    )
    saturated = marks(page, "heatmap", SATURATED)
    overflow = loopback.get(
        f"{server.url}{API}/runs/{twin}/heatmap", params={"metric": "overflow", "max_cols": 2000}
    ).json()
    assert overflow["bucket_width"] == 1
    counted = {}
    for t, row in zip(overflow["tensors"], overflow["values"], strict=True):
        for step, v in zip(overflow["bucket_start"], row, strict=True):
            if v is not None and float(v) > 0:
                counted.setdefault(t["name"], set()).add(step)
    assert counted and saturated == counted, (saturated, counted)
    no_page_errors(page)


def test_a_comparison_with_a_run_gone_nan_across_hundreds_of_tensors(server, page):
    # more non-finite cells than markers are drawn for: the difference fills them in the overlay instead,
    # and still names where the run's began
    layers, steps, bad_from = 100, 200, 50
    runs = [create_run(server.url, name, layers) for name in ("wide-nan", "wide-ok")]
    for run, poisoned in zip(runs, (True, False), strict=True):
        stats = smooth_stats(steps, 3 * layers)
        if poisoned:
            stats["nonfinite"][bad_from:] = 1000.0
            stats["amax"][bad_from:] = 0.0  # the amax ignores NaN: all NaN reads 0
        post_steps(server.url, run["id"], "a", 0, stats)
    bad, ok = (r["id"] for r in runs)
    page.goto(f"{server.url}/#/compare?runs={bad},{ok}")
    page.wait_for_function("() => window.fp8scope.drawn.compare !== undefined")
    info = page.text_content("#compare-diff-info")
    assert info.endswith(f"non-finite elements in #{bad} from step {bad_from}"), info
    drawn = page.evaluate(
        """() => {
        const d = document.getElementById('compare-diff').data;
        const t = d.find(t => t.name === 'non-finite elements in either');
        const overlay = d[1].z.flat();
        return {flagged: t.meta.flagged, markers: t.x.filter(x => x !== null).length, dx: d[0].dx,
                filled: overlay.filter(v => v === 3).length};
    }"""
    )
    cells = 3 * layers * (steps - bad_from)
    assert drawn["dx"] == 1 and drawn["flagged"] == cells > 20000, drawn
    assert drawn["markers"] == 0 and drawn["filled"] == cells, drawn
    no_page_errors(page)
