"""What a tracker shows beside FP8 health: any scalar the job sent (and its events' numbers) charted on
demand and live, every trace extending live, events as markers, the run's config, rename and tags, and a
layers table that agrees with the alerts."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.http import loopback
from tests.support.server import API
from tests.web.browser import (
    FirstReadHeld,
    count_json_reads,
    json_reads,
    no_page_errors,
    open_run,
    wait_json_reads,
)
from tests.web.dashboard_data import create_run, post_steps, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each


def _post(server, rid, key, first, n, extra_scalars, seed=0):
    stats = smooth_stats(n, 6, seed=seed)
    from tests.support.server import batch_body

    body = batch_body(
        key,
        range(first, first + n),
        stats,
        encoding="float64",
        losses=3.0 - 0.01 * np.arange(first, first + n),
    )
    for i, step in enumerate(body["steps"]):
        step["scalars"].update(
            {"grad_norm": 1.0 + 0.01 * (first + i), **{k: f(first + i) for k, f in extra_scalars.items()}}
        )
    r = loopback.post(f"{server.url}{API}/runs/{rid}/telemetry", json=body, timeout=30)
    assert r.status_code == 200, r.text


def _event(server, rid, key, step, name, **details):
    body = {
        "idempotency_key": key,
        "events": [{"kind": "custom", "step": step, "details": {"name": name, **details}}],
    }
    assert loopback.post(f"{server.url}{API}/runs/{rid}/telemetry", json=body, timeout=30).status_code == 200


def traces(page, plot: str) -> dict:
    return page.evaluate(
        f"() => Object.fromEntries((document.getElementById('{plot}').data || [])"
        ".map(t => [t.name, {x: t.x, y: t.y}]))"
    )


def test_a_usual_value_that_appears_live_is_charted_as_on_a_reload(server, page):
    """The first evaluation arrives after the page opened: its val loss is checked and charted, as a reload
    would show it; a usual value the user unchecked stays unchecked when more values appear."""
    run = create_run(server.url, "evals-later", 2)
    rid = run["id"]
    _post(server, rid, "a", 0, 20, {"tokens_per_s": lambda s: 2000.0 + s})
    open_run(page, server.url, rid)
    page.wait_for_function("() => (document.getElementById('scalars-plot').data || []).length === 1")
    page.uncheck("#scalars-picker label[data-name='tokens_per_s'] input")
    _event(server, rid, "e1", 20, "eval", val_loss=2.5)
    page.wait_for_selector("#scalars-picker label[data-name='eval.val_loss'] input:checked")
    page.wait_for_function(
        "() => (document.getElementById('scalars-plot').data || []).some(t => t.name === 'eval.val_loss')"
    )
    assert sorted(traces(page, "scalars-plot")) == ["eval.val_loss"]
    assert not page.is_checked("#scalars-picker label[data-name='tokens_per_s'] input")
    no_page_errors(page)


def test_any_scalar_charted_live_with_events_config_and_tags(server, page):
    config = {"lr": 0.0003, "model": {"n_layer": 2, "n_embd": 64}, "recipe": "delayed"}
    run = create_run(server.url, "tracked", 2, config=config, tags=["sweep-1"])
    rid = run["id"]
    scalars = {
        "accuracy": lambda s: s / 100.0,
        "tokens_per_s": lambda s: 2000.0 + 300.0 * s,
        "lr": lambda s: 3e-4,
    }
    _post(server, rid, "a", 0, 30, scalars)
    _event(server, rid, "e1", 10, "eval", val_loss=2.5)
    _event(server, rid, "e2", 20, "eval", val_loss=2.4)
    _event(server, rid, "e3", 15, "checkpoint", path="ckpt-15.pt")
    open_run(page, server.url, rid)

    # every value on offer; the usual ones charted from the start
    page.wait_for_selector("#scalars-picker label[data-name='eval.val_loss']")
    offered = page.eval_on_selector_all("#scalars-picker label", "ls => ls.map(l => l.dataset.name)")
    assert offered == ["accuracy", "grad_norm", "loss", "lr", "tokens_per_s", "eval.val_loss"]
    page.wait_for_function("() => (document.getElementById('scalars-plot').data || []).length === 3")
    shown = traces(page, "scalars-plot")
    assert sorted(shown) == ["accuracy", "eval.val_loss", "tokens_per_s"]
    assert shown["accuracy"]["x"] == list(range(30)) and shown["accuracy"]["y"][29] == pytest.approx(0.29)
    assert shown["eval.val_loss"] == {"x": [10, 20], "y": [2.5, 2.4]}
    # pick one more
    page.check("#scalars-picker label[data-name='lr'] input")
    page.wait_for_function("() => document.getElementById('scalars-plot').data.length === 4")
    # ticks as numbers are written (plotly's exponent form labelled 4000 tokens/s "0.4e+4")
    ticks = page.eval_on_selector_all(
        "#scalars-plot .yaxislayer-above text", "ts => ts.map(t => t.textContent)"
    )
    assert "4000" in ticks and not any("e+" in t for t in ticks), ticks
    # the val loss beside the loss, and the job's events as markers on it
    curves = traces(page, "curves")
    assert curves["val loss"] == {"x": [10, 20], "y": [2.5, 2.4]}
    assert curves["events"]["x"] == [15]

    # live: every trace extends, not only the loss
    _post(server, rid, "b", 30, 5, scalars, seed=1)
    page.wait_for_function(
        "() => { const d = document.getElementById('curves').data;"
        " const g = d.find(t => t.name === 'grad norm'); return g.x[g.x.length - 1] === 34; }",
        timeout=10_000,
    )
    page.wait_for_function(
        "() => { const a = document.getElementById('scalars-plot').data.find(t => t.name === 'accuracy');"
        " return a.x[a.x.length - 1] === 34; }",
        timeout=10_000,
    )
    _event(server, rid, "e4", 34, "eval", val_loss=2.3)
    page.wait_for_function(
        "() => document.getElementById('curves').data.find(t => t.name === 'val loss').x.length === 3",
        timeout=10_000,
    )

    # the config, every key
    rows = page.eval_on_selector_all(
        "#config-table tr[data-key]", "rs => rs.map(r => [...r.cells].map(c => c.textContent))"
    )
    assert rows == [["lr", "0.0003"], ["model.n_layer", "2"], ["model.n_embd", "64"], ["recipe", "delayed"]]
    # rename and retag from the page (an open server: the page may change things)
    assert page.eval_on_selector_all("#run-tags-list .tag", "ts => ts.map(t => t.textContent)") == ["sweep-1"]
    page.fill("#run-rename", "tracked-renamed")
    page.fill("#run-tags", "sweep-1 best")
    page.click("#run-save")
    page.wait_for_function("() => document.getElementById('run-name').textContent === 'tracked-renamed'")
    got = loopback.get(f"{server.url}{API}/runs/{rid}").json()
    assert got["name"] == "tracked-renamed" and got["tags"] == ["best", "sweep-1"]
    assert page.eval_on_selector_all("#run-tags-list .tag", "ts => ts.map(t => t.textContent)") == [
        "best",
        "sweep-1",
    ]
    page.fill("#run-tags", "has,a bad!tag")
    page.click("#run-save")
    page.wait_for_function(
        "() => document.getElementById('run-edit-error').textContent.startsWith('not saved')"
    )
    assert '"bad!tag" is not a tag' in page.text_content("#run-edit-error")
    assert loopback.get(f"{server.url}{API}/runs/{rid}").json()["tags"] == ["best", "sweep-1"]
    no_page_errors(page)


def test_layers_table_agrees_with_an_alert_before_the_ranking_catches_up(server, page):
    run = create_run(server.url, "agree", 2)
    rid = run["id"]
    post_steps(server.url, rid, "quiet", 0, smooth_stats(40, 6))
    # the engine's ranking as the page fetched it before the fault: every layer healthy (a stale answer,
    # as it was during the refresh delay)
    stale = loopback.get(f"{server.url}{API}/runs/{rid}/layers").json()
    assert {layer["severity"] for layer in stale} == {"ok"}
    page.route(f"**/api/v1/runs/{rid}/layers", lambda route: route.fulfill(json=stale))
    open_run(page, server.url, rid)
    bad = smooth_stats(1, 6, seed=2)
    bad["amax"][0, 4] = np.nan  # blocks.1.mlp.fc.weight
    bad["nonfinite"][0, 4] = 7
    post_steps(server.url, rid, "nan", 40, bad)
    page.wait_for_function(
        "() => [...document.querySelectorAll('#layers-table tbody tr')].some(r => r.cells[0].textContent === "
        "'blocks.1.mlp.fc' && r.cells[1].textContent === 'critical')",
        timeout=10_000,
    )
    first = page.eval_on_selector(
        "#layers-table tbody tr", "r => [r.cells[0].textContent, r.cells[1].textContent]"
    )
    assert first == ["blocks.1.mlp.fc", "critical"]  # worst first
    no_page_errors(page)


def test_a_run_read_older_than_a_save_does_not_undo_it(server, page):
    """A read of the run in flight while the user saves a new name and tags (the stream announced a change
    by someone else) lands after the save and after the page's next read: the header keeps what was saved."""
    rid = create_run(server.url, "before", 2, tags=["old"])["id"]
    path = f"{API}/runs/{rid}"
    count_json_reads(page)
    open_run(page, server.url, rid)
    wait_json_reads(page, path, 2)  # the first load, the stream's opening

    held = FirstReadHeld(page, lambda url: url.endswith(path))
    # someone else retags the run: the stream's "run" event has the page read it again
    assert loopback.patch(f"{server.url}{path}", json={"tags": ["other"]}).status_code == 200
    held.wait("the run was not read again after someone else changed it")

    page.fill("#run-rename", "after")
    page.fill("#run-tags", "saved")
    page.click("#run-save")
    # the save's answer, then the read its own "run" event started, are in
    wait_json_reads(page, path, 4)
    assert page.text_content("#run-name") == "after"
    before = json_reads(page, path)
    held.release()
    wait_json_reads(page, path, before + 1)
    assert page.text_content("#run-name") == "after"
    assert page.eval_on_selector_all("#run-tags-list .tag", "ts => ts.map(t => t.textContent)") == ["saved"]
    no_page_errors(page)
