"""Block-scaled runs on the run page: the block scale exponent histogram of the widest-range tensor drawn as a
heatmap (x step, y unbiased exponent, z blocks) with the posted counts, another tensor picked from its
selector, the four block metrics in the heatmap's metric selector with the API's values, the layers
table's block range column, and the recipe editor offering and sending block scaling."""

from __future__ import annotations

import numpy as np
import pytest

from fp8_protocol.stats import BASE_COLUMNS, BLOCK_COLUMNS, BLOCK_HIST_BINS
from tests.support.http import loopback
from tests.support.server import API, col
from tests.web.browser import no_page_errors, open_run
from tests.web.dashboard_data import create_run, smooth_stats

pytestmark = pytest.mark.slow  # a real browser and server: several seconds each

N_LAYERS = 3
T = 3 * N_LAYERS
STEPS = 120
BLOCKS = 128
WIDEST = 4  # blocks.1.mlp.fc.weight: the widest block range, so the panel opens on it
BLOCK_SCALED = range(6)  # the first two layers; the third stays per-tensor scaled (zeros, no histogram)


def block_run(seed: int = 0) -> tuple[dict[str, np.ndarray], list[list]]:
    """Columns and histograms of a run whose block scales drift down a binade every 40 steps, a tensor's
    histogram spread over 2 + t exponents; tensor 3 has a block pinned at a limit every 10th step."""
    rng = np.random.default_rng(seed)
    stats = smooth_stats(STEPS, T, seed=seed)
    blocks = np.zeros((STEPS, T))
    blocks[:, list(BLOCK_SCALED)] = BLOCKS
    at_limit = np.zeros((STEPS, T))
    at_limit[::10, 3] = 1
    block_range = np.zeros((STEPS, T))
    block_range[:, list(BLOCK_SCALED)] = rng.uniform(3.0, 6.0, (STEPS, len(BLOCK_SCALED)))
    block_range[:, WIDEST] += 4.0
    stats |= {
        "blocks": blocks,
        "blocks_at_limit": at_limit,
        "blocks_overflow": np.zeros((STEPS, T)),
        "blocks_underflow": np.where(blocks > 0, rng.integers(0, 5, (STEPS, T)), 0).astype(np.float64),
        "block_range": block_range,
        "blocks_zero": np.zeros((STEPS, T)),
    }
    hists = []
    for s in range(STEPS):
        entries = []
        for t in BLOCK_SCALED:
            counts = rng.multinomial(BLOCKS - 2, np.ones(2 + t) / (2 + t)) + np.array([1] + [0] * t + [1])
            entries.append([t, 120 - s // 40 - t, counts.tolist()])
        hists.append(entries)
    return stats, hists


def post_block_steps(url: str, run_id: int, first: int, stats: dict, hists: list[list], n: int) -> None:
    """Rows 0..n-1 of `stats` and `hists` as steps first, first + 1, ..."""
    steps = [
        {
            "step": first + i,
            "scalars": {"loss": 3.0 - 0.001 * (first + i), "grad_norm": 1.0},
            "stats": {c: col(stats[c][i], "float64") for c in (*BASE_COLUMNS, *BLOCK_COLUMNS)},
            "block_hist": hists[i],
        }
        for i in range(n)
    ]
    r = loopback.post(
        f"{url}{API}/runs/{run_id}/telemetry",
        json={"idempotency_key": f"from{first}", "steps": steps},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def post_block_run(url: str) -> tuple[dict, dict[str, np.ndarray], list[list]]:
    run = create_run(url, "mxfp8-run", N_LAYERS)
    stats, hists = block_run()
    post_block_steps(url, run["id"], 0, stats, hists, STEPS)
    return run, stats, hists


def sent_sums(hists: list[list], tensor: int, starts: list[int], ends: list[int]) -> np.ndarray:
    """The posted histograms of `tensor` summed over the buckets [starts[c], ends[c]]: (buckets, 256)."""
    out = np.zeros((len(starts), BLOCK_HIST_BINS), dtype=np.int64)
    for c, (a, b) in enumerate(zip(starts, ends, strict=True)):
        for s in range(a, b + 1):
            for t, lo, counts in hists[s]:
                if t == tensor:
                    out[c, lo : lo + len(counts)] += counts
    return out


DRAWN = """() => { const t = document.getElementById('block-hist-plot').data[0];
    return {x: t.x, y: t.y, z: t.z}; }"""


def check_drawn(page, server, run_id: int, hists: list[list], tensor: int) -> None:
    """The drawn heatmap is the API's answer for the page's query, and that is the posted counts."""
    query = page.evaluate("window.fp8scope.blockHistQuery")
    assert query["tensor"] == tensor
    api = loopback.get(f"{server.url}{API}/runs/{run_id}/block-histogram", params=query).json()
    sums = sent_sums(hists, tensor, api["bucket_start"], api["bucket_end"])
    nz = np.flatnonzero(sums.any(axis=0))
    drawn = page.evaluate(DRAWN)
    assert drawn["x"] == api["bucket_start"] and len(drawn["x"]) >= 2
    assert drawn["y"] == [e - 127 for e in range(nz[0], nz[-1] + 1)]  # unbiased exponents
    z = np.array([[0 if v is None else v for v in row] for row in drawn["z"]], dtype=np.int64)
    np.testing.assert_array_equal(z.T, sums[:, nz[0] : nz[-1] + 1])
    assert all(v is None or v > 0 for row in drawn["z"] for v in row)  # empty cells are blank


def test_block_histogram_heatmap_metrics_and_layers_column(server, page):
    run, stats, hists = post_block_run(server.url)
    rid = run["id"]
    open_run(page, server.url, rid)
    page.wait_for_function("() => window.fp8scope.drawn.blockhist !== undefined")
    assert page.is_visible("#block-hist-plot")
    assert page.eval_on_selector("#block-hist-tensor", "s => s.value") == str(WIDEST)
    check_drawn(page, server, rid, hists, WIDEST)

    # another tensor, picked from the selector: redrawn with its own counts
    page.select_option("#block-hist-tensor", "1")
    page.wait_for_function("() => window.fp8scope.blockHistQuery.tensor === 1")
    page.wait_for_function(
        "n => document.getElementById('block-hist-plot').data[0].y.length === n", arg=2 + 1 + STEPS // 40 - 1
    )
    check_drawn(page, server, rid, hists, 1)

    # the heatmap's metric selector offers the four block metrics; the drawn cells are the API's values
    offered = page.eval_on_selector_all("#heatmap-metric option", "os => os.map(o => o.value)")
    assert {"block_at_limit", "block_overflow", "block_underflow", "block_range"} <= set(offered)
    for metric, title, colour_of in (
        ("block_range", "binades", lambda v: v),
        ("block_at_limit", "% of blocks", lambda v: 100.0 * v),
    ):
        page.select_option("#heatmap-metric", metric)
        page.wait_for_function(
            "t => document.getElementById('heatmap').data[0].colorbar.title.text === t", arg=title
        )
        query = {k: v for k, v in page.evaluate("window.fp8scope.heatmapQuery").items() if v is not None}
        api = loopback.get(f"{server.url}{API}/runs/{rid}/heatmap", params=query).json()
        assert api["metric"] == metric and api["aggregation"] == "max"
        z = np.array(page.evaluate("document.getElementById('heatmap').data[0].z"), dtype=np.float64)
        np.testing.assert_allclose(z, colour_of(np.array(api["values"], dtype=np.float64)), rtol=1e-12)
        if metric == "block_at_limit":  # the pinned block of tensor 3: 1 of 128 blocks in its buckets
            assert np.nanmax(z[3]) == pytest.approx(100.0 / BLOCKS) and np.nanmax(np.delete(z, 3, 0)) == 0

    # the layers table: the widest latest block range of each layer (0.0 for the per-tensor layer)
    rows = page.eval_on_selector_all(
        "#layers-table tbody tr", "rs => rs.map(r => [r.cells[0].textContent, r.cells[3].textContent])"
    )
    expected = {
        f"blocks.{k}.mlp.fc": f"{stats['block_range'][-1, 3 * k : 3 * k + 3].max():.1f}" for k in range(3)
    }
    assert dict(rows) == expected
    no_page_errors(page)


def test_layers_table_never_rounds_blocks_at_a_limit_to_none(server, page):
    """One block of 8192 at a scale limit is 0.012%: the block range column says "<0.1% at limit", not
    "0.0% at limit"; one of 128 says 0.8%; none says nothing."""
    run = create_run(server.url, "limits-run", N_LAYERS)
    stats = smooth_stats(1, T, seed=1)
    blocks = np.full((1, T), 8192.0)
    blocks[0, 3:6] = BLOCKS
    at_limit = np.zeros((1, T))
    at_limit[0, 1] = 1  # blocks.0.mlp.fc.weight: 1 of 8192
    at_limit[0, 4] = 1  # blocks.1.mlp.fc.weight: 1 of 128
    stats |= {
        "blocks": blocks,
        "blocks_at_limit": at_limit,
        "blocks_overflow": np.zeros((1, T)),
        "blocks_underflow": np.zeros((1, T)),
        "block_range": np.full((1, T), 5.0),
        "blocks_zero": np.zeros((1, T)),
    }
    post_block_steps(server.url, run["id"], 0, stats, [[]], 1)
    open_run(page, server.url, run["id"])
    page.wait_for_selector("#layers-table tbody tr td.block-range")
    rows = page.eval_on_selector_all(
        "#layers-table tbody tr", "rs => rs.map(r => [r.cells[0].textContent, r.cells[3].textContent])"
    )
    assert dict(rows) == {
        "blocks.0.mlp.fc": "5.0 (<0.1% at limit)",
        "blocks.1.mlp.fc": "5.0 (0.8% at limit)",
        "blocks.2.mlp.fc": "5.0",
    }
    no_page_errors(page)


def test_a_padded_mxfp8_run_shows_its_zero_blocks_apart_from_the_blocks_at_a_limit(server, page, tmp_path):
    """A real MXFP8 run whose batches are half padding (zero rows): its inputs' zero blocks are sparsity, not
    a fault. The layers table reads "50.0% zero" for the first layer, never "at limit", and the API's
    block_at_limit is 0 for every tensor."""
    import torch
    from torch import nn

    from fp8_trainer import Monitor, MXFP8BlockScaling, convert_to_fp8, fp8_autocast
    from tests.trainer.monitor_utils import FAST

    torch.manual_seed(0)
    recipe = MXFP8BlockScaling()
    model = convert_to_fp8(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), recipe=recipe)
    with Monitor(server.url, "mxfp8-padded", model, recipe, spool_path=tmp_path / "s.jsonl", **FAST) as mon:
        for step in range(1, 4):
            x = torch.randn(64, 64)
            x[32:] = 0  # padding: half of the tokens
            with fp8_autocast(fp8_recipe=recipe):
                loss = model(x.requires_grad_()).square().mean()
            loss.backward()
            mon.step(step, loss=loss.detach())
    run = next(r for r in loopback.get(f"{server.url}{API}/runs").json() if r["name"] == "mxfp8-padded")
    answer = loopback.get(f"{server.url}{API}/runs/{run['id']}/layers").json()
    layers = {layer["layer"]: layer for layer in answer}
    first = {t["name"]: t for t in layers["0"]["tensors"]}
    assert first["0.input"]["block_zero"] == 0.5 and first["0.input"]["block_at_limit"] == 0
    assert all(t["block_at_limit"] == 0 for layer in layers.values() for t in layer["tensors"])
    open_run(page, server.url, run["id"])
    page.wait_for_selector("#layers-table tbody tr td.block-range")
    rows = dict(
        page.eval_on_selector_all(
            "#layers-table tbody tr", "rs => rs.map(r => [r.cells[0].textContent, r.cells[3].textContent])"
        )
    )
    assert "(50.0% zero)" in rows["0"] and "at limit" not in rows["0"], rows
    no_page_errors(page)


def test_recipe_editor_sends_block_scaling(server, page):
    run, _, _ = post_block_run(server.url)
    rid = run["id"]
    open_run(page, server.url, rid)
    offered = page.eval_on_selector_all("#recipe-scaling option", "os => os.map(o => o.value)")
    assert offered == ["", "delayed", "current", "mxfp8", "block"]
    page.select_option("#recipe-target", "blocks.2.mlp.fc")
    page.select_option("#recipe-scaling", "mxfp8")
    with page.expect_request(
        lambda r: r.method == "POST" and r.url.endswith(f"/runs/{rid}/commands")
    ) as sent:
        page.click("#recipe-submit")
    assert sent.value.post_data_json == {"target": "blocks.2.mlp.fc", "changes": {"scaling": "mxfp8"}}
    page.wait_for_selector("#commands-table tr[data-command-id]")
    (cmd,) = loopback.get(f"{server.url}{API}/runs/{rid}/commands").json()
    assert cmd["changes"] == {"scaling": "mxfp8"} and cmd["state"] == "pending"
    # the job applies it: the recipe in force lists the layer on block scaling
    body = {
        "idempotency_key": "ack",
        "steps": [{"step": STEPS, "scalars": {"loss": 2.0}}],
        "acks": [{"command_id": cmd["id"], "state": "applied", "step": STEPS}],
    }
    assert loopback.post(f"{server.url}{API}/runs/{rid}/telemetry", json=body).status_code == 200
    page.wait_for_selector("#recipe-effective tr[data-target='blocks.2.mlp.fc']")
    cells = page.eval_on_selector_all(
        "#recipe-effective tr[data-target='blocks.2.mlp.fc'] td", "tds => tds.map(td => td.textContent)"
    )
    assert "mxfp8" in cells
    no_page_errors(page)
