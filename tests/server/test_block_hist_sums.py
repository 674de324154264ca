"""The block histograms' coarse sums (64 / 512 / 4096 steps, `block_hist.update_histogram_sums`) over a long
run: `GET /runs/{id}/block-histogram` answers exactly the sums of the per-step histograms sent, while the run
is live (its last blocks still open), after steps arrive late into sealed blocks, and after compaction; and
each bucket is read from the coarsest sums that fit it."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import func, select, update

from fp8_protocol.stats import BLOCK_HIST_BINS, FP8_MAX
from monitor_server.services.ingest import DecodedBatch, store_batch
from monitor_server.storage import retention
from monitor_server.storage.block_hist import HIST_LEVELS, HistEntry, pack_counts, unpack_counts
from monitor_server.storage.models import BlockHistogram
from monitor_server.storage.rollups import COMPACT_BLOCK
from tests.support.server import API, create_run, random_stats

T = 3  # create_run(n_layers=1): tensors 0 and 1 send histograms, 2 (per-tensor scaled) none
TOTAL = 9037  # two 4096-step blocks sealed, the third open
EARLY_LATE = [5, 100, 1030, 4100, 4101, 8191]  # held back, sent once the run is past them
AFTER_COMPACTION = [2001, 6000, 8100]  # held back until after compaction
KEEP = 1000  # compaction keeps the last 1000 steps (cut at 8032)


def _histograms(rng: np.random.Generator, steps: list[int]) -> dict[int, list[HistEntry]]:
    """Per step, a histogram of tensor 0 (every step) and of tensor 1 (two steps in three)."""
    out = {}
    for s in steps:
        entries = []
        for tensor in (0, 1):
            if tensor == 1 and s % 3 == 0:
                continue
            width = int(rng.integers(1, 7))
            counts = rng.integers(1, 5000, width).astype(np.uint32)
            entries.append(HistEntry(tensor, int(rng.integers(100, 140)), counts.tobytes()))
        out[s] = entries
    return out


def _store(db, run_id: int, steps: list[int], hists: dict[int, list[HistEntry]], key: str) -> None:
    """Store steps through the ingest storage code, under the run's lock, as a telemetry post does."""
    rng = np.random.default_rng(len(steps))
    batch = DecodedBatch(
        idempotency_key=key,
        steps=np.array(steps, dtype=np.int64),
        scalars=[{"loss": 1.0} for _ in steps],
        stats=random_stats(rng, len(steps), T),
        block_hist={s: hists[s] for s in steps},
    )
    fp8_max = np.array([FP8_MAX["e4m3"], FP8_MAX["e4m3"], FP8_MAX["e5m2"]])
    with db.run_lock(run_id), db.write() as session:
        store_batch(session, run_id, batch, fp8_max)


def _dense(hists: dict[int, list[HistEntry]], sent: set[int], tensor: int) -> np.ndarray:
    """(TOTAL, 256) the sent histograms of `tensor` by step (zeros where none was sent)."""
    out = np.zeros((TOTAL, BLOCK_HIST_BINS), dtype=np.uint64)
    for s in sent:
        for e in hists[s]:
            if e.tensor == tensor:
                out[s, e.lo : e.lo + len(e.counts) // 4] = unpack_counts(e.counts, 1)
    return out


def _check(client, run_id: int, hists, sent: set[int], params: dict, aligned_from: int = 0) -> dict:
    """The answer for `params` equals the per-step sums of what was sent, bucket by bucket (a bucket's
    steps clipped to the range; a compacted 8-step block at its start counted whole)."""
    tensor = params["tensor"]
    r = client.get(f"{API}/runs/{run_id}/block-histogram", params=params)
    assert r.status_code == 200, r.text
    answer = r.json()
    dense = _dense(hists, sent, tensor)
    has = np.zeros(TOTAL, dtype=bool)
    has[[s for s in sent if any(e.tensor == tensor for e in hists[s])]] = True
    got = np.zeros((len(answer["counts"]), BLOCK_HIST_BINS), dtype=np.uint64)
    for i, row in enumerate(answer["counts"]):
        got[i, answer["exponent_lo"] : answer["exponent_hi"] + 1] = row
    width = answer["bucket_width"]
    lo, hi = params.get("from", 0), min(params.get("to", TOTAL - 1), max(sent))
    expected, steps, starts = [], [], []
    for b in range(lo // width, hi // width + 1):
        a, z = max(b * width, lo), min((b + 1) * width - 1, hi)
        if a < aligned_from:
            a = a // COMPACT_BLOCK * COMPACT_BLOCK
        if has[a : z + 1].any():
            expected.append(dense[a : z + 1].sum(axis=0))
            steps.append(int(has[a : z + 1].sum()))
            starts.append(max(b * width, lo))
    assert answer["bucket_start"] == starts
    assert answer["bucket_steps"] == steps
    np.testing.assert_array_equal(got, np.array(expected))
    assert len(starts) <= params["max_steps"]
    return answer


# whole-run widths that read each level: 16 (raw and 8-step sums), 128 (64), 1536 (512), 8192 (4096)
QUERIES = [
    {"max_steps": 1000},
    {"max_steps": 100},
    {"max_steps": 7},
    {"max_steps": 2},
    {"max_steps": 1},
    {"from": 130, "to": 8500, "max_steps": 3},
    {"from": 4095, "max_steps": 40},
    {"from": 8200, "max_steps": 1000},  # inside the open block
]


def _sums(db, run_id: int) -> dict[int, int]:
    with db.read_session() as session:
        return dict(
            session.execute(
                select(BlockHistogram.level, func.count())
                .where(BlockHistogram.run_id == run_id)
                .group_by(BlockHistogram.level)
            ).all()
        )


@pytest.mark.parametrize("tensor", [0, 1])
def test_long_run_histograms_are_the_sums_of_what_was_sent(make_client, tensor):
    client = make_client()
    db = client.app.state.ctx.db
    run_id = create_run(client, n_layers=1)["id"]
    hists = _histograms(np.random.default_rng(tensor), list(range(TOTAL)))
    held = set(EARLY_LATE) | set(AFTER_COMPACTION)
    stream = [s for s in range(TOTAL) if s not in held]
    sent: set[int] = set()
    # batches of an odd size, so that seals fall inside batches; checked live, half-way through
    for k, first in enumerate(range(0, len(stream), 701)):
        part = stream[first : first + 701]
        _store(db, run_id, part, hists, f"b{k}")
        sent.update(part)
        if k == 6:
            for q in QUERIES[:4]:
                _check(client, run_id, hists, sent, {"tensor": tensor, **q})
    _store(db, run_id, EARLY_LATE, hists, "late")
    sent.update(EARLY_LATE)
    levels = _sums(db, run_id)
    # the sealed blocks only: the run's last step (9036) is in block 1 of 4096, 17 of 512, 141 of 64
    last = max(sent)
    assert {lv: levels.get(lv, 0) for lv in HIST_LEVELS} == {lv: 2 * (last // lv) for lv in HIST_LEVELS}
    for q in QUERIES:
        _check(client, run_id, hists, sent, {"tensor": tensor, **q})
    cut = retention.compaction_cut(last, KEEP)
    assert retention.compact(db, keep=KEEP)[run_id] > 0
    _store(db, run_id, AFTER_COMPACTION, hists, "later")
    sent.update(AFTER_COMPACTION)
    retention.compact(db, keep=KEEP)
    assert _sums(db, run_id)[COMPACT_BLOCK] == 2 * cut // COMPACT_BLOCK
    for q in QUERIES:
        _check(client, run_id, hists, sent, {"tensor": tensor, **q}, aligned_from=cut)
    _check(client, run_id, hists, sent, {"tensor": tensor, "from": 203, "max_steps": 13}, aligned_from=cut)


def test_buckets_are_read_from_the_coarsest_sums_that_fit(make_client):
    """A sealed sum is what the answer is made of: altered in storage, the answer shows it (and the finer
    levels beneath it are not read)."""
    client = make_client()
    db = client.app.state.ctx.db
    run_id = create_run(client, n_layers=1)["id"]
    steps = list(range(5000))
    hists = _histograms(np.random.default_rng(3), steps)
    for first in range(0, len(steps), 1000):
        _store(db, run_id, steps[first : first + 1000], hists, f"b{first}")
    path = f"{API}/runs/{run_id}/block-histogram"
    for level, max_steps in ((4096, 1), (512, 7), (64, 60)):
        before = client.get(path, params={"tensor": 0, "max_steps": max_steps}).json()
        marker = np.ones(1, dtype=np.uint64)
        with db.write() as session:
            session.execute(
                update(BlockHistogram)
                .where(
                    BlockHistogram.run_id == run_id,
                    BlockHistogram.tensor == 0,
                    BlockHistogram.level == level,
                    BlockHistogram.step == 0,
                )
                .values(lo=0, counts=pack_counts(marker, level), n_steps=1)
            )
        after = client.get(path, params={"tensor": 0, "max_steps": max_steps}).json()
        assert before["bucket_width"] % level == 0 and after["bucket_width"] == before["bucket_width"]
        assert after["bucket_steps"][0] == before["bucket_steps"][0] - level + 1
        assert after["bucket_steps"][1:] == before["bucket_steps"][1:]
        a, b = _full(after), _full(before)
        np.testing.assert_array_equal(a[1:], b[1:])
        assert a[0, 0] == 1 and b[0, 0] == 0  # the marker, at exponent code 0, in the first bucket


def _full(answer: dict) -> np.ndarray:
    out = np.zeros((len(answer["counts"]), BLOCK_HIST_BINS), dtype=np.int64)
    for i, row in enumerate(answer["counts"]):
        out[i, answer["exponent_lo"] : answer["exponent_hi"] + 1] = row
    return out


@pytest.mark.parametrize("tensor", [0, 1])
def test_open_blocks_and_partly_compacted_blocks(make_client, tensor):
    """A run whose last step ends a block at every level (4095): the block is still open, read from the
    steps; a 64-step block compacted in part before it was sealed is summed from both the steps and their
    8-step sums."""
    client = make_client()
    db = client.app.state.ctx.db
    run_id = create_run(client, n_layers=1)["id"]
    hists = _histograms(np.random.default_rng(10 + tensor), list(range(TOTAL)))
    sent: set[int] = set()
    for first in range(0, 4096, 1024):
        part = list(range(first, first + 1024))
        _store(db, run_id, part, hists, f"a{first}")
        sent.update(part)
    assert 4096 not in _sums(db, run_id)
    for max_steps in (1, 7, 60, 1000):
        _check(client, run_id, hists, sent, {"tensor": tensor, "max_steps": max_steps})
    # steps 4096-4123, then compaction in the middle of the open 64-step block [4096, 4159]
    part = list(range(4096, 4124))
    _store(db, run_id, part, hists, "b")
    sent.update(part)
    cut = retention.compaction_cut(max(sent), 20)
    assert cut % 64 and retention.compact(db, keep=20)[run_id] > 0
    part = list(range(4124, 4300))
    _store(db, run_id, part, hists, "c")
    sent.update(part)
    for max_steps in (1, 2, 7, 30, 1000):
        _check(client, run_id, hists, sent, {"tensor": tensor, "max_steps": max_steps}, aligned_from=cut)
