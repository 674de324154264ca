"""The block-scaling statistics on the wire: the five block columns accepted all together or not at all and
stored under their own metric ids; a step's ``block_hist`` validated strictly (a refused batch stores
nothing) and read back through ``GET /runs/{id}/block-histogram`` as it was sent."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import func, select

from fp8_protocol.stats import (
    BASE_COLUMNS,
    BLOCK_COLUMNS,
    BLOCK_HIST_BINS,
    LEGACY_BLOCK_COLUMNS,
    QUALITY_COLUMNS,
)
from monitor_server.storage import retention
from monitor_server.storage.models import BlockHistogram, StepStat
from monitor_server.storage.stat_rows import STAT_IDS, unpack
from tests.support.server import API, col, create_run, random_stats

T = 3  # create_run(n_layers=1)


def block_stats(rng: np.random.Generator, steps: int, tensors: int) -> dict[str, np.ndarray]:
    """Block columns of tensors of 4096 values in 1x32 blocks (128 blocks), the grad_output per-tensor
    scaled (zeros)."""
    blocks = np.full((steps, tensors), 128.0)
    out = {
        "blocks": blocks,
        "blocks_at_limit": rng.integers(0, 3, (steps, tensors)).astype(np.float64),
        "blocks_overflow": rng.integers(0, 2, (steps, tensors)).astype(np.float64),
        "blocks_underflow": rng.integers(0, 20, (steps, tensors)).astype(np.float64),
        "block_range": rng.uniform(2.0, 14.0, (steps, tensors)),
        "blocks_zero": rng.integers(0, 40, (steps, tensors)).astype(np.float64),
    }
    for name in BLOCK_COLUMNS:
        out[name][:, 2] = 0.0
    return out


def _body(key: str, steps: list[int], stats: dict[str, np.ndarray], names_of_step, hists=None) -> dict:
    out = []
    for i, s in enumerate(steps):
        entry = {"step": s, "stats": {n: col(stats[n][i]) for n in names_of_step(i)}}
        if hists is not None and hists[i] is not None:
            entry["block_hist"] = hists[i]
        out.append(entry)
    return {"idempotency_key": key, "steps": out}


def _stored(client, run_id: int, name: str) -> tuple[list[int], np.ndarray]:
    with client.app.state.ctx.db.read_session() as session:
        rows = session.execute(
            select(StepStat.step, StepStat.values)
            .where(StepStat.run_id == run_id, StepStat.metric == STAT_IDS[name])
            .order_by(StepStat.step)
        ).all()
    return [r.step for r in rows], np.array([unpack(r.values, T) for r in rows])


def _histogram_rows(client, run_id: int) -> int:
    with client.app.state.ctx.db.read_session() as session:
        return session.scalar(select(func.count()).where(BlockHistogram.run_id == run_id))


ALL = (*BASE_COLUMNS, *QUALITY_COLUMNS, *BLOCK_COLUMNS)


def _quality(rng: np.random.Generator, steps: int) -> dict[str, np.ndarray]:
    sum_sq = rng.uniform(1.0, 100.0, size=(steps, T))
    return {
        "sum_sq": sum_sq,
        "err_sq": sum_sq * 1e-3,
        "subnormal": np.zeros((steps, T)),
        "min_abs": rng.uniform(1e-6, 1e-3, (steps, T)),
    }


def test_block_columns_are_stored_with_their_values_under_new_ids(client):
    run = create_run(client, n_layers=1)
    rng = np.random.default_rng(1)
    stats = random_stats(rng, 4, T) | _quality(rng, 4) | block_stats(rng, 4, T)
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json=_body("b1", [0, 1, 2, 3], stats, lambda i: ALL))
    assert r.status_code == 200, r.text
    ids = [STAT_IDS[name] for name in BLOCK_COLUMNS]
    assert len(set(STAT_IDS.values())) == len(STAT_IDS) and not set(ids) & set(range(15))  # 0-14 are taken
    for name in ALL:
        steps, values = _stored(client, run["id"], name)
        assert steps == [0, 1, 2, 3]
        np.testing.assert_array_equal(values, stats[name])
    # with the base columns only, and with base and block without the quality columns
    stats2 = random_stats(rng, 2, T) | block_stats(rng, 2, T)
    body = _body("b2", [4, 5], stats2, lambda i: (*BASE_COLUMNS, *BLOCK_COLUMNS))
    assert client.post(f"{API}/runs/{run['id']}/telemetry", json=body).status_code == 200
    assert _stored(client, run["id"], "blocks")[0] == [0, 1, 2, 3, 4, 5]
    assert _stored(client, run["id"], "sum_sq")[0] == [0, 1, 2, 3]


def test_an_older_sender_without_blocks_zero_is_stored_and_its_layers_have_no_zero_share(client):
    # the first five block columns alone (a client from before blocks_zero): stored, nothing invented
    run = create_run(client, n_layers=1)
    rng = np.random.default_rng(2)
    stats = random_stats(rng, 2, T) | block_stats(rng, 2, T)
    body = _body("old", [0, 1], stats, lambda i: (*BASE_COLUMNS, *LEGACY_BLOCK_COLUMNS))
    assert client.post(f"{API}/runs/{run['id']}/telemetry", json=body).status_code == 200
    assert _stored(client, run["id"], "blocks")[0] == [0, 1]
    assert _stored(client, run["id"], "blocks_zero")[0] == []
    layer = client.get(f"{API}/runs/{run['id']}/layers").json()[0]
    assert layer["block_at_limit"] is not None and layer["block_zero"] is None


@pytest.mark.parametrize(
    "names_of_step,needle",
    [
        (
            lambda i: (*BASE_COLUMNS, "blocks", "block_range"),
            "steps[0].stats: the block statistics ['blocks', 'blocks_at_limit', 'blocks_overflow',"
            " 'blocks_underflow', 'block_range', 'blocks_zero'] come all together or not at all; missing"
            " ['blocks_at_limit', 'blocks_overflow', 'blocks_underflow', 'blocks_zero']",
        ),
        (
            lambda i: (*BASE_COLUMNS, *BLOCK_COLUMNS) if i == 0 else BASE_COLUMNS,
            "steps[1].stats: columns",
        ),
        (
            lambda i: (*BASE_COLUMNS, *BLOCK_COLUMNS, "blocks_nan"),
            "steps[0].stats: unknown statistic(s) ['blocks_nan']",
        ),
        (lambda i: (*BASE_COLUMNS[1:], *BLOCK_COLUMNS), "steps[0].stats: missing statistic(s) ['amax']"),
    ],
)
def test_block_columns_half_sent_are_refused_whole(client, names_of_step, needle):
    run = create_run(client, n_layers=1)
    rng = np.random.default_rng(3)
    stats = random_stats(rng, 2, T) | block_stats(rng, 2, T)
    stats["blocks_nan"] = np.zeros((2, T))
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json=_body("h", [0, 1], stats, names_of_step))
    assert r.status_code == 422 and needle in r.json()["detail"], r.text
    assert client.get(f"{API}/runs/{run['id']}").json()["steps_stored"] == 0


def _hist(rng: np.random.Generator, tensors=(0, 1)) -> list:
    """A step's block_hist: for each tensor a span of exponents around 2^-7 (code 120) whose counts sum to
    its 128 blocks."""
    out = []
    for t in tensors:
        width = int(rng.integers(1, 6))
        counts = rng.multinomial(128, np.ones(width) / width).tolist()
        counts[0] = counts[0] or 1
        counts[-1] = counts[-1] or 1
        out.append([t, int(rng.integers(110, 125)), counts])
    return out


def get_histogram(client, run_id: int, **params) -> dict:
    r = client.get(f"{API}/runs/{run_id}/block-histogram", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def dense(answer: dict) -> np.ndarray:
    """The answer's counts as (buckets, 256) by biased exponent."""
    out = np.zeros((len(answer["counts"]), BLOCK_HIST_BINS), dtype=np.int64)
    if answer["counts"]:
        lo = answer["exponent_lo"]
        out[:, lo : answer["exponent_hi"] + 1] = np.array(answer["counts"])
    return out


def sent_dense(hists: list, tensor: int) -> np.ndarray:
    """What was sent for `tensor`, (steps, 256)."""
    out = np.zeros((len(hists), BLOCK_HIST_BINS), dtype=np.int64)
    for i, step in enumerate(hists):
        for t, lo, counts in step or []:
            if t == tensor:
                out[i, lo : lo + len(counts)] += counts
    return out


def test_block_histograms_round_trip_through_the_api(client):
    run = create_run(client, n_layers=1)
    rng = np.random.default_rng(5)
    S = 20
    stats = random_stats(rng, S, T) | block_stats(rng, S, T)
    hists = [_hist(rng) for _ in range(S)]
    hists[3] = None  # a step without one
    hists[4] = [[1, 0, [5]], [0, 256 - 3, [1, 0, 127]]]  # both ends of the code range
    body = _body("h", list(range(10, 10 + S)), stats, lambda i: (*BASE_COLUMNS, *BLOCK_COLUMNS), hists)
    assert client.post(f"{API}/runs/{run['id']}/telemetry", json=body).status_code == 200
    for tensor in (0, 1):
        for key in (tensor, f"blocks.0.mlp.fc.{('input', 'weight')[tensor]}"):
            answer = get_histogram(client, run["id"], tensor=key)
            assert answer["tensor"]["index"] == tensor and answer["bucket_width"] == 1
            assert answer["exponent_bias"] == 127
            sent = sent_dense(hists, tensor)
            has = sent.any(axis=1)
            assert answer["bucket_start"] == answer["bucket_end"] == [10 + i for i in np.flatnonzero(has)]
            assert answer["bucket_steps"] == [1] * int(has.sum())
            np.testing.assert_array_equal(dense(answer), sent[has])
            # the exponent range is exactly the span of what was sent
            nz = np.flatnonzero(sent.any(axis=0))
            assert (answer["exponent_lo"], answer["exponent_hi"]) == (nz[0], nz[-1])
    # a tensor without histograms (per-tensor scaled) and a range without steps answer empty
    for params in ({"tensor": 2}, {"tensor": 0, "from": 1000}):
        answer = get_histogram(client, run["id"], **params)
        assert answer["counts"] == [] and answer["bucket_start"] == [] and answer["exponent_lo"] is None
    # a part of the range
    answer = get_histogram(client, run["id"], tensor=0, **{"from": 15, "to": 17})
    np.testing.assert_array_equal(dense(answer), sent_dense(hists, 0)[5:8])


def test_block_histogram_route_refuses_bad_requests(client):
    run = create_run(client, n_layers=1)
    rid = run["id"]
    cases = [
        (f"/runs/{rid}/block-histogram", {"tensor": "nope"}, 404, f"run {rid} has no tensor 'nope'"),
        (f"/runs/{rid}/block-histogram", {"tensor": 3}, 404, f"run {rid} has no tensor '3'"),
        (f"/runs/{rid}/block-histogram", {"tensor": "99999999999"}, 404, "has no tensor"),
        ("/runs/4242/block-histogram", {"tensor": 0}, 404, "run 4242 not found"),
        (f"/runs/{rid}/block-histogram", {}, 422, "tensor"),
        (f"/runs/{rid}/block-histogram", {"tensor": 0, "max_steps": 0}, 422, "max_steps"),
        (f"/runs/{rid}/block-histogram", {"tensor": 0, "from": 9, "to": 3}, 422, "to (3) is before from (9)"),
    ]
    for path, params, code, needle in cases:
        r = client.get(API + path, params=params)
        assert r.status_code == code and needle in r.text, (params, r.text)


def _refused(client, run_id: int, hist, needle: str, status: int = 422, with_blocks: bool = True) -> None:
    rng = np.random.default_rng(9)
    stats = random_stats(rng, 2, T) | block_stats(rng, 2, T)
    names = (*BASE_COLUMNS, *BLOCK_COLUMNS) if with_blocks else BASE_COLUMNS
    body = _body("bad", [0, 1], stats, lambda i: names, [_hist(rng), hist])
    r = client.post(f"{API}/runs/{run_id}/telemetry", json=body)
    assert r.status_code == status, r.text
    assert r.json()["detail"] == needle
    assert client.get(f"{API}/runs/{run_id}").json()["steps_stored"] == 0  # nothing of the batch stored
    assert _histogram_rows(client, run_id) == 0


@pytest.mark.parametrize(
    "hist,needle",
    [
        ({"0": [1]}, "steps[1].block_hist: expected an array of [tensor index, lo, counts]"),
        ([[0, 1]], "steps[1].block_hist[0]: expected [tensor index, lo, counts]"),
        ([[3, 120, [1]]], "steps[1].block_hist[0][0] (tensor index): must be in [0, 2], got 3"),
        ([[-1, 120, [1]]], "steps[1].block_hist[0][0] (tensor index): must be in [0, 2], got -1"),
        ([[0.0, 120, [1]]], "steps[1].block_hist[0][0] (tensor index): expected an integer, got float"),
        ([[True, 120, [1]]], "steps[1].block_hist[0][0] (tensor index): expected an integer, got bool"),
        ([[0, 256, [1]]], "steps[1].block_hist[0][1] (lo): must be in [0, 255], got 256"),
        ([[0, -1, [1]]], "steps[1].block_hist[0][1] (lo): must be in [0, 255], got -1"),
        ([[0, "120", [1]]], "steps[1].block_hist[0][1] (lo): expected an integer, got str"),
        (
            [[0, 250, [1] * 7]],
            "steps[1].block_hist[0][2] (counts): expected an array of 1 to 6 counts"
            " (lo + len(counts) <= 256)",
        ),
        (
            [[0, 0, []]],
            "steps[1].block_hist[0][2] (counts): expected an array of 1 to 256 counts"
            " (lo + len(counts) <= 256)",
        ),
        ([[0, 120, [1, -2]]], "steps[1].block_hist[0][2][1] (count): must be in [0, 4294967295], got -2"),
        (
            [[0, 120, [1, 2**32]]],
            "steps[1].block_hist[0][2][1] (count): must be in [0, 4294967295], got 4294967296",
        ),
        ([[0, 120, [1, 2.5]]], "steps[1].block_hist[0][2][1] (count): expected an integer, got float"),
        ([[0, 120, [None]]], "steps[1].block_hist[0][2][0] (count): expected an integer, got NoneType"),
        (
            [[0, 120, [1]], [0, 121, [1]]],
            "steps[1].block_hist[1]: a second histogram of tensor 0 in one step",
        ),
        (
            [[0, 120, [1]], [1, 120, [1]], [2, 120, [1]], [0, 1, [1]]],
            "steps[1].block_hist: 4 entries for a run of 3 tensors (at most one per tensor)",
        ),
    ],
)
def test_malformed_block_histograms_are_refused(client, hist, needle):
    run = create_run(client, n_layers=1)
    _refused(client, run["id"], hist, needle)


def test_block_histograms_need_the_block_columns(client):
    run = create_run(client, n_layers=1)
    _refused(
        client,
        run["id"],
        [[0, 120, [1]]],
        "steps[0].block_hist: sent without the block statistics ['blocks', 'blocks_at_limit',"
        " 'blocks_overflow', 'blocks_underflow', 'block_range', 'blocks_zero'] in the step's stats",
        with_blocks=False,
    )
    body = {"idempotency_key": "s", "steps": [{"step": 0, "block_hist": [[0, 120, [1]]]}]}
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json=body)
    assert r.status_code == 422 and r.json()["detail"] == "steps[0].block_hist: sent without the step's stats"


def test_a_hostile_histogram_is_refused_by_the_parse_budget_before_it_is_parsed(make_client):
    """Millions of counts cost nothing: the body's JSON values are counted (max_json_elements) before it
    is parsed, and the answer is 413."""
    client = make_client(max_json_elements=10_000)
    run = create_run(client, n_layers=1)
    rng = np.random.default_rng(2)
    stats = random_stats(rng, 1, T) | block_stats(rng, 1, T)
    body = _body("big", [0], stats, lambda i: (*BASE_COLUMNS, *BLOCK_COLUMNS), [[[0, 0, [1] * 256]] * 50])
    r = client.post(f"{API}/runs/{run['id']}/telemetry", json=body)
    assert r.status_code == 413, r.text
    assert _histogram_rows(client, run["id"]) == 0


def test_all_zero_entries_store_nothing_and_a_repeated_step_keeps_the_first(client):
    run = create_run(client, n_layers=1)
    rng = np.random.default_rng(4)
    stats = random_stats(rng, 1, T) | block_stats(rng, 1, T)
    names = (*BASE_COLUMNS, *BLOCK_COLUMNS)
    body = _body("z", [0], stats, lambda i: names, [[[0, 100, [0, 0]], [1, 100, [0, 7, 0]]]])
    assert client.post(f"{API}/runs/{run['id']}/telemetry", json=body).status_code == 200
    assert _histogram_rows(client, run["id"]) == 1
    answer = get_histogram(client, run["id"], tensor=1)
    assert (answer["exponent_lo"], answer["exponent_hi"], answer["counts"]) == (101, 101, [[7]])
    # the same step again in another batch: stored once, the first histogram kept
    body = _body("z2", [0], stats, lambda i: names, [[[1, 90, [3]]]])
    assert client.post(f"{API}/runs/{run['id']}/telemetry", json=body).json()["stored_steps"] == 0
    assert get_histogram(client, run["id"], tensor=1)["counts"] == [[7]]


def test_late_steps_below_the_compaction_cut_join_their_block_sum(client):
    """Steps that arrive after their range was compacted are folded into the stored 8-step sums by the next
    compaction: the histogram over them stays the sum of everything sent."""
    run = create_run(client, n_layers=1)
    rng = np.random.default_rng(6)
    S = 120
    stats = random_stats(rng, S, T) | block_stats(rng, S, T)
    hists = [_hist(rng) for _ in range(S)]
    names = (*BASE_COLUMNS, *BLOCK_COLUMNS)
    late = [10, 11, 12, 30]
    early = [s for s in range(S) if s not in late]
    pick = {k: v[early] for k, v in stats.items()}
    body = _body("early", early, pick, lambda i: names, [hists[s] for s in early])
    assert client.post(f"{API}/runs/{run['id']}/telemetry", json=body).status_code == 200
    db = client.app.state.ctx.db
    assert retention.compact(db, keep=40)  # cut at step 80
    body = _body(
        "late", late, {k: v[late] for k, v in stats.items()}, lambda i: names, [hists[s] for s in late]
    )
    assert client.post(f"{API}/runs/{run['id']}/telemetry", json=body).status_code == 200
    assert retention.compact(db, keep=40)[run["id"]] == 4 * len(BASE_COLUMNS + BLOCK_COLUMNS) + 4 * 2
    with db.read_session() as session:
        levels = dict(
            session.execute(
                select(BlockHistogram.level, func.count())
                .where(BlockHistogram.run_id == run["id"])
                .group_by(BlockHistogram.level)
            ).all()
        )
    # and the sealed 64-step sum (steps 0-63), which took the late steps in as they arrived
    assert levels == {1: 2 * (S - 80), 8: 2 * (80 // 8), 64: 2 * (S // 64)}
    for tensor in (0, 1):
        answer = get_histogram(client, run["id"], tensor=tensor, max_steps=1000)
        assert answer["bucket_width"] == 8 and answer["bucket_steps"][:2] == [8, 8]
        sent = sent_dense(hists, tensor)
        expected = np.array(
            [
                sent[a : b + 1].sum(axis=0)
                for a, b in zip(answer["bucket_start"], answer["bucket_end"], strict=True)
            ]
        )
        np.testing.assert_array_equal(dense(answer), expected)


def test_block_histogram_route_needs_the_read_scope(make_client):
    client = make_client(tokens=["trainer:ingest:trainer-secret-1", "dash:read:dash-secret-1"])
    trainer = {"Authorization": "Bearer trainer-secret-1"}
    run = create_run(client, n_layers=1, headers=trainer)
    path = f"{API}/runs/{run['id']}/block-histogram"
    assert client.get(path, params={"tensor": 0}).status_code == 401
    r = client.get(path, params={"tensor": 0}, headers=trainer)
    assert r.status_code == 403 and "lacks the scope 'read'" in r.json()["detail"]
    r = client.get(path, params={"tensor": 0}, headers={"Authorization": "Bearer dash-secret-1"})
    assert r.status_code == 200 and r.json()["counts"] == []
