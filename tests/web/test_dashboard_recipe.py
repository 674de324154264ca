"""The recipe editor: a change made in the page reaches GET /runs/{id}/commands with the right content, its
state follows the training job's delivery and acknowledgement live, and applied changes can be rolled back."""

from __future__ import annotations

import pytest

from tests.support.http import loopback
from tests.support.server import API
from tests.web.browser import no_page_errors, open_run
from tests.web.dashboard_data import create_run, post_steps, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

#: true when the audit trail's row of command `id` is in `state`
STATE_IS = (
    "([id, state]) => document.querySelector(`#commands-table tr[data-command-id='${id}']`)"
    ".dataset.state === state"
)


def state_cell(page, command_id: int) -> str:
    return page.text_content(f"#commands-table tr[data-command-id='{command_id}'] td.command-state")


def test_recipe_change_round_trip(server, page):
    run = create_run(server.url, "recipe-run", 2)
    rid = run["id"]
    post_steps(server.url, rid, "a", 0, smooth_stats(60, 6))
    open_run(page, server.url, rid)

    page.select_option("#recipe-target", "blocks.1.mlp.fc")
    page.fill("#recipe-margin", "2")
    page.select_option("#recipe-fp8", "off")
    page.select_option("#recipe-algo", "most_recent")
    page.click("#recipe-submit")
    page.wait_for_selector("#commands-table tr[data-command-id]")
    commands = loopback.get(f"{server.url}{API}/runs/{rid}/commands").json()
    assert len(commands) == 1
    cmd = commands[0]
    assert cmd["kind"] == "recipe_change" and cmd["target"] == "blocks.1.mlp.fc"
    assert cmd["changes"] == {"margin": 2, "fp8_enabled": False, "amax_compute_algo": "most_recent"}
    assert cmd["state"] == "pending" and state_cell(page, cmd["id"]) == "pending"

    # the training job's next batch delivers it ...
    reply = post_steps(server.url, rid, "b", 60, smooth_stats(1, 6))
    assert [c["id"] for c in reply["commands"]] == [cmd["id"]]
    page.wait_for_function(
        STATE_IS,
        arg=[cmd["id"], "delivered"],
        timeout=2000,
    )
    # ... and a later one acknowledges it as applied at step 61
    post_steps(
        server.url,
        rid,
        "c",
        61,
        smooth_stats(1, 6),
        acks=[{"command_id": cmd["id"], "state": "applied", "step": 61}],
    )
    page.wait_for_function(
        STATE_IS,
        arg=[cmd["id"], "applied"],
        timeout=2000,
    )
    assert state_cell(page, cmd["id"]) == "applied at step 61"
    # the recipe in force now lists the layer override
    page.wait_for_selector("#recipe-effective tr[data-target='blocks.1.mlp.fc']")
    cells = page.eval_on_selector_all(
        "#recipe-effective tr[data-target='blocks.1.mlp.fc'] td", "tds => tds.map(td => td.textContent)"
    )
    assert cells == ["blocks.1.mlp.fc", "2", "16", "most_recent", "1", "delayed", "off"]

    # roll it back from the audit trail
    page.click(f"#commands-table tr[data-command-id='{cmd['id']}'] button.rollback")
    page.wait_for_function(
        "() => document.querySelectorAll('#commands-table tr[data-command-id]').length === 2"
    )
    latest = loopback.get(f"{server.url}{API}/runs/{rid}/commands").json()[0]
    assert latest["kind"] == "rollback" and latest["rollback_of"] == cmd["id"]
    assert latest["changes"] == {"margin": 0, "fp8_enabled": True, "amax_compute_algo": "max"}

    # a rejection shows with its reason
    post_steps(server.url, rid, "d", 62, smooth_stats(1, 6))
    post_steps(
        server.url,
        rid,
        "e",
        63,
        smooth_stats(1, 6),
        acks=[{"command_id": latest["id"], "state": "rejected", "reason": "layer is frozen"}],
    )
    page.wait_for_function(
        STATE_IS,
        arg=[latest["id"], "rejected"],
        timeout=2000,
    )
    assert state_cell(page, latest["id"]) == "rejected: layer is frozen"

    # a bad value is refused in the page with a message naming the field, nothing is sent
    page.fill("#recipe-interval", "0")
    page.click("#recipe-submit")
    assert "interval" in page.text_content("#recipe-error")
    assert len(loopback.get(f"{server.url}{API}/runs/{rid}/commands").json()) == 2
    no_page_errors(page)


def test_a_run_that_ends_closes_the_form_and_its_pending_command_live(server, page):
    run = create_run(server.url, "recipe-ends", 2)
    rid = run["id"]
    post_steps(server.url, rid, "a", 0, smooth_stats(20, 6))
    open_run(page, server.url, rid)
    assert not page.is_disabled("#recipe-submit")
    page.fill("#recipe-margin", "1")
    page.click("#recipe-submit")
    page.wait_for_selector("#commands-table tr[data-command-id]")
    (cmd,) = loopback.get(f"{server.url}{API}/runs/{rid}/commands").json()

    r = loopback.patch(f"{server.url}{API}/runs/{rid}", json={"status": "finished"})
    assert r.status_code == 200, r.text
    page.wait_for_function(STATE_IS, arg=[cmd["id"], "rejected"], timeout=5000)
    assert state_cell(page, cmd["id"]) == "rejected: the run ended (finished) before the job applied it"
    page.wait_for_function("() => document.querySelector('#recipe-submit').disabled")
    assert "the run is finished" in page.text_content("#recipe-readonly")
    assert page.is_disabled("#recipe-margin")
    no_page_errors(page)


#: for each cell of the "In force" table: its text, and whether, scrolled into its box's view, the point at
#: its centre is the cell itself (not the "Change" form beside it, drawn over it)
CELLS_ON_TOP = """() => {
  const box = document.querySelector('#recipe-effective');
  const out = [];
  for (const cell of box.querySelectorAll('th, td')) {
    cell.scrollIntoView({block: 'center', inline: 'nearest'});
    const r = cell.getBoundingClientRect();
    const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
    out.push([cell.textContent, hit === cell || cell.contains(hit)]);
  }
  return out;
}"""


def test_in_force_table_is_never_drawn_under_the_change_form(server, page):
    # the recipe panel is one column of two; its "In force" table has a column per setting, and the "Change"
    # form comes under it, not beside it: every cell reachable and on top (tests/web/test_dashboard_layout.py:
    # all of them in sight at 1280 px)
    run = create_run(server.url, "recipe-wide", 2)
    post_steps(server.url, run["id"], "a", 0, smooth_stats(5, 6))
    open_run(page, server.url, run["id"])
    page.wait_for_selector("#recipe-effective table.recipe td")
    cells = page.evaluate(CELLS_ON_TOP)
    assert len(cells) >= 14, cells  # target and every setting, header and the model row
    hidden = [text for text, on_top in cells if not on_top]
    assert not hidden, f"cells drawn under another element: {hidden}"
    no_page_errors(page)


def test_a_current_or_block_scaling_run_greys_the_settings_it_does_not_use(server, page):
    # current scaling takes each scale from the tensor's own amax, block scaling each block's from the
    # block's: margin, history, algorithm and interval are delayed scaling's, shown greyed with the reason;
    # a delayed run's table has none of that
    cells_js = "tds => tds.map(td => [td.textContent, td.classList.contains('unused')])"
    runs = {}
    for scaling in ("current", "mxfp8", "block", "delayed"):
        run = create_run(server.url, f"{scaling}-run", 2, recipe={"format": "HYBRID", "scaling": scaling})
        post_steps(server.url, run["id"], "a", 0, smooth_stats(5, 6))
        open_run(page, server.url, run["id"])
        page.wait_for_selector("#recipe-effective tr[data-target='model'] td")
        runs[scaling] = page.eval_on_selector_all("#recipe-effective tr[data-target='model'] td", cells_js)
        note = page.locator("#recipe-unused-note")
        if scaling == "delayed":
            assert note.count() == 0
        else:
            assert f"not used by {scaling} scaling" in note.text_content()
    unused = [True] * 4
    for scaling in ("current", "mxfp8", "block"):
        assert runs[scaling] == [[v, u] for v, u in zip(
            ["model", "0", "1024", "max", "1", scaling, "on"], [False, *unused, False, False], strict=True
        )]  # fmt: skip
    assert [u for _, u in runs["delayed"]] == [False] * 7 and runs["delayed"][5][0] == "delayed"
    no_page_errors(page)


def test_an_applied_change_is_marked_where_it_took_effect(server, page):
    """A change applied while the page is open gets a star on the loss curve and at the heatmap's top row,
    named in its hover, and a dashed line across both plots at the step it took effect; a pending or
    rejected change gets none."""
    run = create_run(server.url, "marked-run", 2)
    rid = run["id"]
    post_steps(server.url, rid, "a", 0, smooth_stats(60, 6))
    open_run(page, server.url, rid)
    applied = loopback.post(f"{server.url}{API}/runs/{rid}/commands", json={"changes": {"margin": 2}}).json()
    refused = loopback.post(
        f"{server.url}{API}/runs/{rid}/commands",
        json={"target": "blocks.0.mlp.fc", "changes": {"interval": 3}},
    ).json()
    loopback.post(f"{server.url}{API}/runs/{rid}/commands", json={"changes": {"margin": 1}})  # stays pending
    post_steps(server.url, rid, "b", 60, smooth_stats(1, 6))  # delivers them
    acks = [
        {"command_id": applied["id"], "state": "applied", "step": 61},
        {"command_id": refused["id"], "state": "rejected", "reason": "no"},
    ]
    post_steps(server.url, rid, "c", 61, smooth_stats(1, 6), acks=acks)
    marks = "id => (document.getElementById(id).data || []).find(t => t.name === 'recipe changes')"
    for plot in ("curves", "heatmap"):
        page.wait_for_function(f"id => {{ const t = ({marks})(id); return t && t.x.length > 0; }}", arg=plot)
        trace = page.evaluate(f"id => {{ const t = ({marks})(id); return {{x: t.x, text: t.text}}; }}", plot)
        assert trace["x"] == [61], plot
        (text,) = trace["text"]
        assert text.startswith(f"recipe change #{applied['id']} (model) at step 61: margin = 2 (was "), text
        lines = page.evaluate(
            "id => document.getElementById(id).layout.shapes"
            ".filter(s => s.type === 'line').map(s => [s.x0, s.x1])",
            plot,
        )
        assert lines == [[61, 61]], plot
    no_page_errors(page)


def test_compare_shows_the_changes_applied_to_each_run(server, page):
    """Two runs from the same config, one given a margin during training: the comparison says so beside
    the config, and marks the step in that run's colour on its scalars and on the difference heatmap."""
    changed = create_run(server.url, "margin-pushed", 2)
    plain = create_run(server.url, "untouched", 2)
    for run in (changed, plain):
        post_steps(server.url, run["id"], "a", 0, smooth_stats(30, 6))
    cmd = loopback.post(
        f"{server.url}{API}/runs/{changed['id']}/commands", json={"changes": {"margin": 2}}
    ).json()
    post_steps(server.url, changed["id"], "b", 30, smooth_stats(1, 6))
    acks = [{"command_id": cmd["id"], "state": "applied", "step": 31}]
    post_steps(server.url, changed["id"], "c", 31, smooth_stats(9, 6), acks=acks)
    post_steps(server.url, plain["id"], "b", 30, smooth_stats(10, 6))

    page.goto(f"{server.url}/#/compare?runs={changed['id']},{plain['id']}")
    page.wait_for_function("() => window.fp8scope.drawn.compare !== undefined")
    row = page.eval_on_selector(
        "#compare-config tr[data-key='recipe changes applied']", "tr => [...tr.cells].map(c => c.textContent)"
    )
    assert row == ["recipe changes applied", "margin = 2 at step 31", "none"]
    stars = page.evaluate(
        "() => document.getElementById('compare-loss').data"
        ".filter(t => (t.name || '').endsWith('recipe changes')).map(t => [t.name, t.x, t.marker.color])"
    )
    colours = page.evaluate(
        "() => [...document.querySelectorAll('#compare-runs .swatch')]"
        ".map(s => getComputedStyle(s).backgroundColor)"
    )
    assert len(stars) == 1 and stars[0][:2] == [f"#{changed['id']} margin-pushed: recipe changes", [31]]
    lines = {
        plot: page.evaluate(
            "id => document.getElementById(id).layout.shapes"
            ".filter(s => s.type === 'line').map(s => [s.x0, s.line.color])",
            plot,
        )
        for plot in ("compare-loss", "compare-diff")
    }
    assert lines["compare-loss"] == lines["compare-diff"] == [[31, stars[0][2]]]
    assert colours[0] == "rgb(31, 119, 180)" and stars[0][2] == "#1f77b4"  # the changed run's colour
    no_page_errors(page)
