"""What a laptop screen shows whole: the heatmap of a 48-tensor run (the tiny GPT's) down to its last row, the
comparison's step ticks above the table under them, and every column of the recipe in force at 1280 px."""

from __future__ import annotations

import pytest

from tests.support.http import loopback
from tests.support.server import API
from tests.web.browser import VIEWPORT, no_page_errors, open_run
from tests.web.dashboard_data import create_run, post_steps, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

#: laptop screens: the tests' default and a 1280 x 800 one
SCREENS = (VIEWPORT, {"width": 1280, "height": 800})

#: the run page's heatmap scrolled into sight as opened: the last row's band, what is at its centre (three
#: points across the plot), the visible part of the scroll box and the step axis strip (null when hidden)
LAST_ROW = """() => {
  const gd = document.getElementById('heatmap');
  const box = gd.closest('.heatmap-scroll');
  box.scrollIntoView({block: 'end'});
  const strip = document.getElementById('heatmap-axis');
  const L = gd._fullLayout;
  const R = gd.data[0].z.length;
  const area = gd.querySelector('.nsewdrag').getBoundingClientRect();
  const y = area.y + L.yaxis.l2p(R - 1);
  const hits = [0.05, 0.5, 0.95].map((f) => {
    const hit = document.elementFromPoint(area.x + f * area.width, y);
    return gd.contains(hit) && !strip.contains(hit);
  });
  const b = box.getBoundingClientRect();
  const s = strip.hidden ? null : strip.getBoundingClientRect();
  return {rows: R, scrollTop: box.scrollTop, hits, rowTop: area.y + L.yaxis.l2p(R - 1.5),
          rowBottom: area.y + L.yaxis.l2p(R - 0.5), boxTop: b.top + box.clientTop,
          boxBottom: b.top + box.clientTop + box.clientHeight, strip: s && {top: s.top, bottom: s.bottom}};
}"""


def test_the_last_row_of_a_48_tensor_run_shows_not_under_the_step_axis(server, page):
    run = create_run(server.url, "heatmap-48", 16)  # 16 layers: 48 tensors, the tiny GPT's
    post_steps(server.url, run["id"], "a", 0, smooth_stats(200, 48))
    for screen in SCREENS:
        page.set_viewport_size(screen)
        page.goto("about:blank")
        open_run(page, server.url, run["id"], stream=False)
        view = page.evaluate(LAST_ROW)
        assert view["rows"] == 48 and view["scrollTop"] == 0, view
        # as opened: the last row is inside the box's visible part, its cells are the plot's, and no axis
        # strip lies over it
        assert all(view["hits"]), (screen, view)
        assert view["boxTop"] <= view["rowTop"] and view["rowBottom"] <= view["boxBottom"], (screen, view)
        assert view["strip"] is None or view["strip"]["top"] >= view["rowBottom"], (screen, view)
    no_page_errors(page)


#: the comparison's difference heatmap with the caption of the table under it in sight: the step tick labels
#: (the stuck strip's where it shows, else the plot's own), each with its box and whether the point at its
#: centre belongs to the plot or the strip, the visible part of the scroll box, and the caption's box
TICKS = """() => {
  const gd = document.getElementById('compare-diff');
  const box = gd.closest('.heatmap-scroll');
  const caption = document.querySelector('#compare-diff-layers caption');
  caption.scrollIntoView({block: 'end'});
  const strip = document.getElementById('compare-diff-axis');  // none before the page had one
  const shown = Boolean(strip && !strip.hidden);
  const labels = [...(shown ? strip.querySelectorAll('.tick') : gd.querySelectorAll('.xtick text'))];
  const rect = (e) => { const r = e.getBoundingClientRect(); return {top: r.top, bottom: r.bottom}; };
  const b = box.getBoundingClientRect();
  return {
    strip: shown,
    labels: labels.map((e) => {
      const r = e.getBoundingClientRect();
      const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
      return {text: e.textContent, ...rect(e), inPlot: gd.contains(hit) || (shown && strip.contains(hit))};
    }),
    boxTop: b.top + box.clientTop, boxBottom: b.top + box.clientTop + box.clientHeight,
    caption: rect(caption),
  };
}"""


def test_the_comparison_s_step_ticks_show_above_its_caption(server, page):
    # 48 tensors: the difference fits its box; 300: it is taller, and its ticks are in a strip stuck to the
    # box's bottom, as on the run page
    for layers, strip in ((16, False), (100, True)):
        a, b = (create_run(server.url, f"ticks-{layers}-{k}", layers) for k in "ab")
        for seed, run in enumerate((a, b)):
            post_steps(server.url, run["id"], "a", 0, smooth_stats(200, 3 * layers, seed=seed))
        page.goto("about:blank")
        page.goto(f"{server.url}/#/compare?runs={a['id']},{b['id']}")
        page.wait_for_function("() => window.fp8scope.drawn.compare !== undefined")
        view = page.evaluate(TICKS)
        assert view["strip"] == strip, view
        labels = view["labels"]
        assert len(labels) >= 3 and labels[0]["text"] == "0", view
        caption = view["caption"]
        for label in labels:
            # inside the box's visible part, above the caption, not under anything
            assert view["boxTop"] <= label["top"] and label["bottom"] <= view["boxBottom"], (layers, label)
            assert label["bottom"] <= caption["top"] or label["top"] >= caption["bottom"], (layers, label)
            assert label["inPlot"], (layers, label)
    no_page_errors(page)


#: the recipe in force: its scroll box's widths, its box, and per header its text and box, whether its text is
#: cut, and whether the point at its centre is the header itself
COLUMNS = """() => {
  const box = document.getElementById('recipe-effective');
  box.scrollIntoView({block: 'center'});
  const b = box.getBoundingClientRect();
  return {
    scrollWidth: box.scrollWidth, clientWidth: box.clientWidth,
    left: b.left + box.clientLeft, right: b.left + box.clientLeft + box.clientWidth,
    headers: [...box.querySelectorAll('th')].map((th) => {
      const r = th.getBoundingClientRect();
      const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
      return {text: th.textContent, left: r.left, right: r.right, cut: th.scrollWidth > th.clientWidth,
              onTop: hit === th || th.contains(hit)};
    }),
  };
}"""


def test_every_column_of_the_recipe_in_force_shows_at_1280_px(server, page):
    page.set_viewport_size({"width": 1280, "height": 800})
    run = create_run(server.url, "recipe-1280", 2)
    rid = run["id"]
    post_steps(server.url, rid, "a", 0, smooth_stats(5, 6))
    # a layer's override too: a second row, with a layer's name and the longest value
    r = loopback.post(
        f"{server.url}{API}/runs/{rid}/commands",
        json={
            "target": "blocks.1.mlp.fc",
            "changes": {"amax_compute_algo": "most_recent", "fp8_enabled": False},
        },
    )
    assert r.status_code == 201, r.text
    cid = r.json()["id"]
    post_steps(server.url, rid, "b", 5, smooth_stats(1, 6))  # delivered
    post_steps(
        server.url, rid, "c", 6, smooth_stats(1, 6), acks=[{"command_id": cid, "state": "applied", "step": 6}]
    )
    open_run(page, server.url, rid)
    page.wait_for_selector("#recipe-effective tr[data-target='blocks.1.mlp.fc']")
    view = page.evaluate(COLUMNS)
    assert [h["text"] for h in view["headers"]] == [
        "target",
        "margin",
        "amax history len",
        "amax compute algo",
        "interval",
        "scaling",
        "fp8 enabled",
    ]
    # nothing to scroll to: every header whole, inside the box's visible part and on top
    assert view["scrollWidth"] <= view["clientWidth"], view
    for header in view["headers"]:
        assert view["left"] - 0.5 <= header["left"] and header["right"] <= view["right"] + 0.5, header
        assert not header["cut"] and header["onTop"], header
    no_page_errors(page)
