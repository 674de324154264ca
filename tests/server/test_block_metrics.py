"""The block-scaling heatmap metrics, the block scale exponent histograms and the layers table's block fields
of a realistic MXFP8 run, posted through the HTTP API of a real `fp8-monitor serve` on each backend:
every answer equals what this file computes by hand from the tensors it quantized, at several widths,
and stays right once the service has compacted the older steps."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from sqlalchemy import func, select

from fp8_protocol.stats import BASE_COLUMNS, BLOCK_COLUMNS, BLOCK_HIST_BINS
from monitor_server.core.db import make_engine
from monitor_server.storage.models import BlockHistogram, StepStat
from monitor_server.storage.retention import compaction_cut
from monitor_server.storage.rollups import COMPACT_BLOCK
from monitor_server.storage.stat_rows import STAT_IDS
from tests.support.http import loopback
from tests.support.polling import wait_for
from tests.support.server import API, ServerProcess, col, create_run, decode

N_LAYERS = 3
T = 3 * N_LAYERS
BLOCK = 32  # MXFP8: 1x32 blocks along the last dimension, E8M0 scales
SHAPE = (8, 128)  # 32 blocks a tensor
S = 240
FIRST = 3  # the run starts at step 3: its first 8-step block is partial
KEEP = 64
E4M3_MAX, E4M3_EMAX = 448.0, 8
#: layer 2 stays per-tensor scaled: its tensors report zeros in the block columns and send no histogram
BLOCK_SCALED = np.array([t < 6 for t in range(T)])


def mxfp8_step(x: np.ndarray) -> tuple[dict[str, float], tuple[int, np.ndarray]]:
    """One tensor's statistics under MXFP8 as the OCP spec scales it (shared exponent floor(log2 amax) − 8,
    the E8M0 code that plus 127, clamped to [0, 254]; saturation past 464, flush below 2^-10 after
    scaling), and its exponent histogram (lo, counts over the non-zero span)."""
    blocks = np.abs(x).reshape(-1, BLOCK)
    amax = blocks.max(axis=1)
    with np.errstate(divide="ignore"):
        code = np.where(amax > 0, np.floor(np.log2(amax)) - E4M3_EMAX + 127, 0).astype(np.int64)
    pinned = (code <= 0) | (code >= 254)
    code = np.clip(code, 0, 254)
    scale_inv = 2.0 ** (code - 127).astype(np.float64)
    scaled = blocks / scale_inv[:, None]
    over = scaled > 464.0
    under = (blocks > 0) & (scaled < 2.0**-10)
    with np.errstate(divide="ignore"):
        smallest = np.where(blocks > 0, blocks, np.inf).min(axis=1)
        rng = np.where(np.isfinite(smallest), np.log2(amax / smallest), 0.0)
    holder = int(np.argmax(amax))
    counts = np.bincount(code, minlength=BLOCK_HIST_BINS)
    nz = np.flatnonzero(counts)
    stats = {
        "amax": float(amax.max()),
        "scale": float(1.0 / scale_inv[holder]),
        "overflow": float(over.sum()),
        "underflow": float(under.sum()),
        "nonfinite": 0.0,
        "numel": float(x.size),
        "blocks": float(len(blocks)),
        "blocks_at_limit": float(pinned.sum()),
        "blocks_overflow": float(over.any(axis=1).sum()),
        "blocks_underflow": float(under.any(axis=1).sum()),
        "block_range": float(rng.max()),
    }
    return stats, (int(nz[0]), counts[nz[0] : nz[-1] + 1])


def per_tensor_step(x: np.ndarray, fp8_max: float) -> dict[str, float]:
    amax = float(np.abs(x).max())
    scale = 2.0 ** np.floor(np.log2(fp8_max / amax))
    return {
        "amax": amax,
        "scale": scale,
        "overflow": 0.0,
        "underflow": float(((x != 0) & (np.abs(x) * scale < 2.0**-10)).sum()),
        "nonfinite": 0.0,
        "numel": float(x.size),
        **dict.fromkeys(BLOCK_COLUMNS, 0.0),
    }


def simulate(seed: int = 7) -> tuple[dict[str, np.ndarray], list[list]]:
    """(S, T) columns and the steps' block_hist of a run whose activations drift up, with a tiny-valued
    block in tensor 3 now and then (its scale pinned at E8M0's bottom code), an outlier block in tensor 0
    at step 150 and a wide block (values across many binades) in tensor 4 at step 90."""
    rng = np.random.default_rng(seed)
    columns = {n: np.zeros((S, T)) for n in (*BASE_COLUMNS, *BLOCK_COLUMNS)}
    hists: list[list] = []
    for i in range(S):
        entries = []
        for t in range(T):
            x = rng.normal(0.0, 1.0 + i / 100.0, SHAPE) * (0.05 if t % 3 == 2 else 1.0)
            if t == 3 and i % 37 == 5:
                x[0, :BLOCK] = rng.normal(0.0, 1e-40, BLOCK)  # below E8M0's smallest scale: pinned
            if t == 0 and i == 150:
                x[3, 64 : 64 + BLOCK] *= 1e4
            if t == 4 and i == 90:
                x[5, :BLOCK] = 2.0 ** rng.uniform(-30, 4, BLOCK)
            if BLOCK_SCALED[t]:
                stats, (lo, counts) = mxfp8_step(x)
                entries.append([t, lo, counts.tolist()])
            else:
                stats = per_tensor_step(x, 57344.0 if t % 3 == 2 else E4M3_MAX)
            for name, value in stats.items():
                columns[name][i, t] = value
        hists.append(entries)
    return columns, hists


def expected_metrics(c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The four heatmap metrics per step, by hand: shares of the tensor's blocks (0 without blocks)."""
    blocks = c["blocks"]
    safe = np.where(blocks == 0, 1.0, blocks)
    share = {
        name: np.where(blocks == 0, 0.0, c[column] / safe)
        for name, column in (
            ("block_at_limit", "blocks_at_limit"),
            ("block_overflow", "blocks_overflow"),
            ("block_underflow", "blocks_underflow"),
        )
    }
    return share | {"block_range": c["block_range"]}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A served database holding the simulated run, posted in out-of-order batches of 50 steps."""
    tmp = tmp_path_factory.mktemp("blocks")
    if request.param == "sqlite":
        db_url = f"sqlite:///{tmp / 'm.db'}"
    else:
        db_url = request.getfixturevalue("new_pg_schema")()
    columns, hists = simulate()
    steps = np.arange(S) + FIRST
    server = ServerProcess(db_url, log_path=tmp / "server.log").start()
    state = {"db_url": db_url, "server": server, "columns": columns, "hists": hists, "tmp": tmp}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            run = create_run(http, n_layers=N_LAYERS)
            for a in (50, 0, 200, 100, 150):
                sel = range(a, min(a + 50, S))
                body = {
                    "idempotency_key": f"b{a}",
                    "steps": [
                        {
                            "step": int(steps[i]),
                            "scalars": {"loss": 2.0},
                            "stats": {n: col(columns[n][i], "float64") for n in columns},
                            "block_hist": hists[i],
                        }
                        for i in sel
                    ],
                }
                r = http.post(f"{API}/runs/{run['id']}/telemetry", json=body)
                assert r.status_code == 200, r.text
        state["run"] = run
        yield state
    finally:
        state["server"].stop()  # the one serving now (the compaction test restarts it)
    assert "Traceback" not in state["server"].log_text(), state["server"].log_text()


def get(served: dict, path: str, **params) -> dict | list:
    r = loopback.get(
        f"{served['server'].url}{API}/runs/{served['run']['id']}{path}", params=params, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()


def bucket_max(per_step: np.ndarray, hm: dict) -> tuple[np.ndarray, list[int]]:
    """The bucket max of per-step values (S, T) over the answer's buckets, and the steps in each."""
    steps = np.arange(S) + FIRST
    out = np.full((T, len(hm["bucket_start"])), np.nan)
    counts = []
    for c, (a, b) in enumerate(zip(hm["bucket_start"], hm["bucket_end"], strict=True)):
        rows = per_step[(steps >= a) & (steps <= b)]
        counts.append(len(rows))
        if len(rows):
            out[:, c] = rows.max(axis=0)
    return out, counts


def sent_histograms(hists: list[list], tensor: int) -> np.ndarray:
    """What was sent for `tensor`: (S, 256) counts by biased exponent."""
    out = np.zeros((S, BLOCK_HIST_BINS), dtype=np.int64)
    for i, entries in enumerate(hists):
        for t, lo, counts in entries:
            if t == tensor:
                out[i, lo : lo + len(counts)] = counts
    return out


def dense(answer: dict) -> np.ndarray:
    out = np.zeros((len(answer["counts"]), BLOCK_HIST_BINS), dtype=np.int64)
    if answer["counts"]:
        out[:, answer["exponent_lo"] : answer["exponent_hi"] + 1] = answer["counts"]
    return out


def bucket_sums(sent: np.ndarray, answer: dict) -> np.ndarray:
    steps = np.arange(S) + FIRST
    return np.array(
        [
            sent[(steps >= a) & (steps <= b)].sum(axis=0)
            for a, b in zip(answer["bucket_start"], answer["bucket_end"], strict=True)
        ]
    ).reshape(-1, BLOCK_HIST_BINS)


RANGES = (
    {"max_cols": 1000},
    {"max_cols": 37},
    {"max_cols": 7},
    {"from": 20, "to": 199, "max_cols": 11},
    {"from": 100, "to": 103, "max_cols": 4},
    {"max_cols": 1},
)
METRICS = ("block_at_limit", "block_overflow", "block_underflow", "block_range")


def test_the_simulated_run_exercises_every_block_metric():
    columns, hists = simulate()
    m = expected_metrics(columns)
    assert m["block_at_limit"][:, 3].max() > 0 and m["block_at_limit"][:, 0].max() == 0
    assert m["block_overflow"].max() > 0 and m["block_underflow"].max() > 0
    assert np.argmax(m["block_range"][:, 4]) == 90 and m["block_range"][90, 4] > 25
    assert (m["block_range"][:, ~BLOCK_SCALED] == 0).all()
    assert all(len(e) == int(BLOCK_SCALED.sum()) for e in hists)


def test_block_heatmaps_equal_the_hand_computation(served):
    per_step = expected_metrics(served["columns"])
    for metric, params in itertools.product(METRICS, RANGES):
        hm = get(served, "/heatmap", metric=metric, **params)
        assert hm["metric"] == metric and hm["aggregation"] == "max"
        assert 1 <= len(hm["bucket_start"]) <= params["max_cols"]
        expected, counts = bucket_max(per_step[metric], hm)
        assert hm["bucket_steps"] == counts
        got = np.array([decode(row) for row in hm["values"]])
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    # the spikes are not averaged away in one column over the whole run
    whole = np.array([decode(r) for r in get(served, "/heatmap", metric="block_range", max_cols=1)["values"]])
    assert whole[4, 0] == served["columns"]["block_range"][90, 4]
    at_limit = np.array(
        [decode(r) for r in get(served, "/heatmap", metric="block_at_limit", max_cols=1)["values"]]
    )
    assert at_limit[3, 0] == 1 / 32 and at_limit[6, 0] == 0.0


def test_block_histograms_bucket_to_sums_of_what_was_sent(served):
    for tensor in (0, 3, 5):
        sent = sent_histograms(served["hists"], tensor)
        for max_steps, rng in itertools.product((1000, 41, 5, 1), ({}, {"from": 17, "to": 150})):
            answer = get(served, "/block-histogram", tensor=tensor, max_steps=max_steps, **rng)
            assert 1 <= len(answer["bucket_start"]) <= max_steps
            width = answer["bucket_width"]
            # aligned buckets: each starts at a multiple of the width (or at the range's start)
            lo = rng.get("from", FIRST)
            assert all(s == lo or s % width == 0 for s in answer["bucket_start"])
            np.testing.assert_array_equal(dense(answer), bucket_sums(sent, answer))
            # every block of every step counted once: a bucket holds 32 blocks a step
            assert [sum(row) for row in answer["counts"]] == [32 * n for n in answer["bucket_steps"]]
    # the tensor pinned at E8M0's bottom shows its code 0 blocks (unbiased exponent -127)
    answer = get(served, "/block-histogram", tensor=3, max_steps=1)
    assert answer["exponent_lo"] == 0 and answer["counts"][0][0] == sum(1 for i in range(S) if i % 37 == 5)
    assert get(served, "/block-histogram", tensor=8)["counts"] == []  # per-tensor scaled: none sent


def test_layers_table_shows_the_latest_block_statistics(served):
    columns = served["columns"]
    layers = {layer["layer"]: layer for layer in get(served, "/layers")}
    share = expected_metrics(columns)["block_at_limit"][-1]
    for k in range(N_LAYERS):
        layer = layers[f"blocks.{k}.mlp.fc"]
        idx = slice(3 * k, 3 * k + 3)
        assert layer["block_range"] == columns["block_range"][-1, idx].max()
        assert layer["block_at_limit"] == share[idx].max()
        for t in layer["tensors"]:
            assert t["block_range"] == columns["block_range"][-1, t["index"]]
    assert layers["blocks.2.mlp.fc"]["block_range"] == 0.0  # per-tensor scaled: zeros, not null


def _kept(db_url: str, run_id: int) -> tuple[int | None, int, int]:
    """(first step with per-step statistics, per-step histogram rows, 8-step histogram rows)."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            first = conn.scalar(
                select(func.min(StepStat.step)).where(
                    StepStat.run_id == run_id, StepStat.metric == STAT_IDS["amax"]
                )
            )
            levels = dict(
                conn.execute(
                    select(BlockHistogram.level, func.count())
                    .where(BlockHistogram.run_id == run_id)
                    .group_by(BlockHistogram.level)
                ).all()
            )
    finally:
        engine.dispose()
    return first, levels.get(1, 0), levels.get(COMPACT_BLOCK, 0)


def test_compaction_keeps_the_answers(served):
    """Runs last in this module: the service is restarted with bounded storage and compacts the run (and
    is stopped at the end)."""
    run_id = served["run"]["id"]
    coarse = [{"max_cols": 20}, {"max_cols": 7}, {"from": 24, "to": 199, "max_cols": 11}, {"max_cols": 1}]
    before = {
        (m, i): get(served, "/heatmap", metric=m, **p)
        for m, (i, p) in itertools.product(METRICS, enumerate(coarse))
    }
    hist_before = {
        (t, n): get(served, "/block-histogram", tensor=t, max_steps=n)
        for t, n in itertools.product((0, 3), (20, 3))
    }
    served["server"].stop()
    env = {"FP8SCOPE_RAW_STEPS_KEPT": str(KEEP), "FP8SCOPE_STALL_CHECK_SECONDS": "0.05"}
    served["server"] = ServerProcess(
        served["db_url"], log_path=served["tmp"] / "server2.log", env=env
    ).start()
    cut = compaction_cut(S + FIRST - 1, KEEP)
    # watched through the API (a second process opening the SQLite file while the service writes it can
    # lose the service's write-ahead log): once compacted, the heatmap is drawn at 8 steps at the finest
    wait_for(
        lambda: get(served, "/heatmap", metric="amax", max_cols=1000)["bucket_width"] == COMPACT_BLOCK,
        60,
        f"compaction to step {cut}",
    )

    for (m, i), old in before.items():
        assert get(served, "/heatmap", metric=m, **coarse[i]) == old
    for (t, n), old in hist_before.items():
        assert get(served, "/block-histogram", tensor=t, max_steps=n) == old
    # asked finer than the compacted blocks: 8-step buckets there, each the sum of its steps as sent
    for tensor in (0, 3):
        answer = get(served, "/block-histogram", tensor=tensor, max_steps=1000)
        assert answer["bucket_width"] == COMPACT_BLOCK
        np.testing.assert_array_equal(
            dense(answer), bucket_sums(sent_histograms(served["hists"], tensor), answer)
        )
        # a range starting inside the kept steps is still per step
        kept = get(served, "/block-histogram", tensor=tensor, max_steps=1000, **{"from": cut})
        assert kept["bucket_width"] == 1 and len(kept["bucket_start"]) == S + FIRST - cut
    # the rows, once the service has stopped: the kept steps' own, and one sum per tensor and 8 steps before
    served["server"].stop()
    first, raw, summed = _kept(served["db_url"], run_id)
    assert first == cut
    assert raw == int(BLOCK_SCALED.sum()) * (S + FIRST - cut)
    assert summed == int(BLOCK_SCALED.sum()) * (cut // COMPACT_BLOCK)
