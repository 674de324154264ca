"""What a user sees first on a run's page: the verdict line under the header (how the run stands, each
incident with its root cause and step, linked), the incidents before the per-layer table, each layer's
reasons on one line; and the loss curves' smoothing, log axis and a grad-norm panel only when the run sent
a grad norm. On the demo's run (a real `fp8-train` with the demo's injected faults) and on API-made runs."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.http import loopback
from tests.support.server import API, batch_body
from tests.web.browser import VIEWPORT, no_page_errors, open_run, wait_drawn
from tests.web.dashboard_data import create_run, smooth_stats

pytestmark = pytest.mark.slow  # a real training, a real browser and server

# scripts/demo.sh's training: a saturating weight at step 120, a learning-rate spike at step 220
DEMO = ["--preset", "tiny", "--steps", "300", "--recipe", "delayed", "--eval-interval", "100"]
DEMO += ["--inject", "overflow:blocks.2.mlp.fc@120", "--inject", "lr-spike@220"]


def rect(page, selector: str) -> dict:
    return page.evaluate(
        "s => { const r = document.querySelector(s).getBoundingClientRect();"
        " return {top: r.top, bottom: r.bottom, left: r.left, right: r.right, height: r.height}; }",
        selector,
    )


def overlap(a: dict, b: dict) -> bool:
    apart_x = a["right"] <= b["left"] or b["right"] <= a["left"]
    return not (apart_x or a["bottom"] <= b["top"] or b["bottom"] <= a["top"])


@pytest.fixture(scope="module")
def demo_run(server, tmp_path_factory) -> int:
    cmd = [sys.executable, "-m", "fp8_trainer.app.cli", *DEMO, "--monitor-url", server.url]
    cmd += ["--run-name", "verdict-demo", "--no-progress", "--log-interval", "1000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cwd = tmp_path_factory.mktemp("demo")
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = loopback.get(f"{server.url}{API}/runs", params={"q": "verdict-demo"}).json()
    return next(r["id"] for r in runs if r["name"] == "verdict-demo")


def test_the_demo_run_says_what_went_wrong_under_its_header(server, page, demo_run):
    open_run(page, server.url, demo_run, stream=False)
    page.wait_for_selector("#run-verdict .verdict-item")
    # the first thing under the header, on the first screen, red: the run finished with critical incidents
    assert page.evaluate("document.querySelector('.run-head').nextElementSibling.id") == "run-verdict"
    assert rect(page, "#run-verdict")["bottom"] < VIEWPORT["height"]
    assert page.get_attribute("#run-verdict", "data-kind") == "bad"
    head = page.text_content("#run-verdict .verdict-head")
    assert head.startswith("Finished at step 300") and "open incident" in head, head
    items = page.eval_on_selector_all("#run-verdict .verdict-item", "lis => lis.map(li => li.textContent)")
    saturation = [t for t in items if "blocks.2.mlp.fc.weight" in t]
    assert saturation and "step 120" in saturation[0], items
    # the learning-rate spike's incident, the step after it: its loss spike is one of its alerts (the root
    # cause is the first by tensor order, so a tensor that saturated in the same step comes before it)
    assert any("step 221" in t for t in items), items
    alerts = loopback.get(f"{server.url}{API}/runs/{demo_run}/alerts").json()
    spikes = [a for a in alerts if a["kind"] == "loss_spike"]
    assert spikes and spikes[0]["first_step"] == 221, alerts
    incidents = loopback.get(f"{server.url}{API}/runs/{demo_run}/incidents").json()
    assert any(i["id"] == spikes[0]["incident_id"] and i["first_step"] == 221 for i in incidents), incidents
    # the header's status stays a green "finished": the loss ended finite
    assert page.text_content(".run-head .badge.ok") == "finished"

    # the incidents come before the per-layer table
    order = page.evaluate(
        "document.getElementById('incidents').compareDocumentPosition(document.getElementById('layers-table'))"
    )
    assert order & 4, order  # DOCUMENT_POSITION_FOLLOWING: the table is after the incidents

    # the saturation's link opens its incident (alerts unfolded) and brings it into view
    link = page.locator("#run-verdict .verdict-link", has_text="blocks.2.mlp.fc.weight")
    incident = link.get_attribute("data-incident-id")
    assert link.get_attribute("href") == f"#/runs/{demo_run}?incident={incident}"
    link.click()
    item = f"li.incident[data-incident-id='{incident}']"
    page.wait_for_function(f'() => document.querySelector("{item} details").open')
    box = rect(page, item)
    assert 0 <= box["top"] < VIEWPORT["height"], box

    # the header's counts lead to the incidents too
    page.evaluate("window.scrollTo(0, document.body.scrollHeight)")
    page.click("#run-open-incidents")
    page.wait_for_function("() => { const r = document.getElementById('incidents').getBoundingClientRect();"
                           " return r.top >= 0 && r.top < innerHeight; }")  # fmt: skip

    # each layer's reasons on one line, the rest behind a button
    page.wait_for_selector("#layers-table tbody tr")
    heights = page.eval_on_selector_all(
        "#layers-table tbody tr td.reasons-cell .reason-line",
        "ls => ls.map(l => l.getBoundingClientRect().height)",
    )
    assert heights and max(heights) < 24, heights
    folded = page.locator("#layers-table tbody tr", has=page.locator("button.reasons-more")).first
    hidden = folded.locator("ul.reasons")
    assert hidden.is_hidden()
    folded.locator("button.reasons-more").click()
    assert hidden.is_visible() and hidden.locator("li").count() >= 1
    assert page.locator("#drilldown").is_hidden()  # unfolding is not a click on the row

    # the learning rate's axis title clear of its tick labels
    title = rect(page, "#curves text.y3title")
    ticks = page.eval_on_selector_all(
        "#curves .y3tick text",
        "ts => ts.map(t => { const r = t.getBoundingClientRect();"
        " return {top: r.top, bottom: r.bottom, left: r.left, right: r.right}; })",
    )
    assert ticks and not any(overlap(title, t) for t in ticks), (title, ticks)

    # the drill-down's heading: the layer's name as spelled, on one line
    page.click("#layers-table tr:has(td.name:text-is('blocks.2.mlp.fc')) td.name")
    page.wait_for_selector("#drilldown-plot .main-svg")
    name = page.locator("#drilldown-layer")
    assert name.inner_text() == "blocks.2.mlp.fc"
    assert rect(page, "#drilldown-layer")["height"] < 24
    no_page_errors(page)


def _run_without_grad_norm(url: str, steps: int = 60) -> int:
    run = create_run(url, "no-grad-norm", n_layers=2)
    stats = smooth_stats(steps, 6)
    losses = 3.0 * np.exp(-np.arange(steps) / 20) + 0.1 * np.sin(np.arange(steps))
    body = batch_body("a", range(steps), stats, encoding="float64", losses=losses)
    assert loopback.post(f"{url}{API}/runs/{run['id']}/telemetry", json=body, timeout=60).status_code == 200
    assert loopback.patch(f"{url}{API}/runs/{run['id']}", json={"status": "finished"}).status_code == 200
    return run["id"], losses


def test_curves_smooth_the_loss_draw_it_on_a_log_axis_and_leave_out_a_grad_norm_never_sent(server, page):
    rid, losses = _run_without_grad_norm(server.url)
    open_run(page, server.url, rid, stream=False)
    layout = page.evaluate(
        "(() => { const l = document.getElementById('curves')._fullLayout;"
        " return {grad: l.yaxis2.visible, domain: l.yaxis.domain, anchor: l.xaxis.anchor}; })()"
    )
    assert layout == {"grad": False, "domain": [0, 1], "anchor": "y"}, layout  # no empty grad-norm panel
    grad = page.evaluate("document.getElementById('curves').data.find(t => t.name === 'grad norm')")
    assert grad["visible"] is False
    page.wait_for_selector("#run-verdict .verdict-head")
    assert page.text_content("#run-verdict .verdict-head") == "Finished at step 59: no incident."
    assert page.get_attribute("#run-verdict", "data-kind") == "ok"

    # smoothing: TensorBoard's debiased exponential moving average, drawn over the faded raw loss
    slider = "e => { e.value = '0.9'; e.dispatchEvent(new Event('input')); }"
    page.eval_on_selector("#curves-smoothing", slider)
    smoothed = "(document.getElementById('curves').data || []).find(t => t.name === 'loss (smoothed 0.90)')"
    page.wait_for_function(f"() => {{ const t = {smoothed}; return t && t.visible === true; }}")
    got = page.evaluate(f"{smoothed}.y")
    avg, want = 0.0, []
    for n, v in enumerate(losses, start=1):
        avg = 0.9 * avg + 0.1 * v
        want.append(avg / (1 - 0.9**n))
    np.testing.assert_allclose(got, want, rtol=1e-9)
    assert got[0] == pytest.approx(losses[0])  # debiased: the first point is the first loss, not 0.1 of it

    # log y, kept with the smoothing across a reload
    page.check("#curves-log-y")
    page.wait_for_function("() => document.getElementById('curves')._fullLayout.yaxis.type === 'log'")
    page.reload()
    wait_drawn(page, "heatmap", "curves")
    assert page.evaluate("document.getElementById('curves')._fullLayout.yaxis.type") == "log"
    assert page.input_value("#curves-smoothing") == "0.9"
    no_page_errors(page)
