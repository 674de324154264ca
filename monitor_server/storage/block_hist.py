"""Block scale exponent histograms (block-scaled tensors: MXFP8 1x32, FP8 block 1x128 / 128x128): decoding the
step's ``block_hist`` (`fp8_protocol.stats.BLOCK_HIST_BINS`), storing, compacting and reading them.

A step's entry ``[tensor index, lo, counts]`` says that ``counts[j]`` of the tensor's blocks had a
``scale_inv`` with the biased binary exponent ``lo + j`` (the E8M0 code; 127 means [1, 2)). One
`BlockHistogram` row per tensor and step holds ``lo`` and the counts as little-endian uint32, trimmed to
their non-zero span. Compaction (`retention.compact`) replaces the rows of the compacted steps with one row
per tensor and block of `rollups.COMPACT_BLOCK` steps holding their sum (uint64), so a histogram over a
compacted range is still exact, at 8-step resolution or coarser. Coarse sums per tensor and block of 64,
512 and 4096 steps (`HIST_LEVELS`) are written at ingest once the run has moved past the block
(`update_histogram_sums`), so that a long range is read from about `max_steps` rows (`read_histogram`).

The API (`GET /runs/{id}/block-histogram`) sums a tensor's histograms over aligned buckets of steps: counts,
not fractions, so that a bucket's column says how many blocks (over its steps) sat at each exponent, and the
sum of a column is the bucket's blocks; the dashboard normalises if it wants shares.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session

from fp8_protocol.codec import WireError, encode_float
from fp8_protocol.stats import BLOCK_HIST_BINS, block_fraction
from monitor_server.storage.models import BlockHistogram, Run, StepStat
from monitor_server.storage.rollups import (
    COMPACT_BLOCK,
    LEVELS,
    cover,
    late_steps,
    plan_heatmap,
    sealed_blocks,
)
from monitor_server.storage.stat_rows import STAT_IDS, read_step_stats_each

#: the largest count one step's entry may carry (stored as uint32): 2^32 - 1 blocks of 32 values are
#: 1.4e11 values, beyond any one tensor
MAX_BLOCK_COUNT = 2**32 - 1
#: the bias of the stored exponents: an unbiased exponent (the binade of scale_inv) is the code minus 127
EXPONENT_BIAS = 127

_U4 = np.dtype("<u4")
_U8 = np.dtype("<u8")
#: the array module's code of a 32-bit unsigned integer (`I` where an int is 32 bits, as on every platform
#: CPython runs the service on; `L` otherwise)
_U32_CODE = "I" if array("I").itemsize == 4 else "L"
assert array(_U32_CODE).itemsize == 4 and sys.byteorder == "little", "uint32 counts are read as <u4"


@dataclass(frozen=True)
class HistEntry:
    """One tensor's histogram in one step: counts[j] blocks at biased exponent lo + j (non-zero span)."""

    tensor: int
    lo: int
    counts: bytes  # little-endian uint32, as stored


def _int(value: Any, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{where}: expected an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise WireError(f"{where}: must be in [{lo}, {hi}], got {value}")
    return value


def decode_block_hist(value: Any, num_tensors: int, where: str) -> list[HistEntry]:
    """Validate a step's ``block_hist`` for a run of `num_tensors` tensors: at most one entry per tensor,
    each ``[tensor index, lo, counts]`` with 0 <= lo, 1 <= len(counts), lo + len(counts) <= 256 and counts
    integers in [0, 2^32 - 1]. Every size is checked before anything is allocated for it (the body's JSON
    values were counted against the parse budget before it was parsed).

    Raises:
        WireError: naming the offending entry.
    """
    if not isinstance(value, list):
        raise WireError(f"{where}: expected an array of [tensor index, lo, counts]")
    if len(value) > num_tensors:
        raise WireError(
            f"{where}: {len(value)} entries for a run of {num_tensors} tensors (at most one per tensor)"
        )
    seen: set[int] = set()
    out = []
    for k, entry in enumerate(value):
        at = f"{where}[{k}]"
        if not isinstance(entry, list) or len(entry) != 3:
            raise WireError(f"{at}: expected [tensor index, lo, counts]")
        tensor = _int(entry[0], f"{at}[0] (tensor index)", 0, num_tensors - 1)
        if tensor in seen:
            raise WireError(f"{at}: a second histogram of tensor {tensor} in one step")
        seen.add(tensor)
        lo = _int(entry[1], f"{at}[1] (lo)", 0, BLOCK_HIST_BINS - 1)
        counts = entry[2]
        if not isinstance(counts, list) or not 1 <= len(counts) <= BLOCK_HIST_BINS - lo:
            raise WireError(
                f"{at}[2] (counts): expected an array of 1 to {BLOCK_HIST_BINS - lo} counts"
                f" (lo + len(counts) <= {BLOCK_HIST_BINS})"
            )
        # integers only (a JSON true is not a count), in range: both checked in C, element by element
        try:
            packed = array(_U32_CODE, counts)
            ok = set(map(type, counts)) == {int}
        except (TypeError, OverflowError):
            ok = False
        if not ok:
            for j, c in enumerate(counts):  # find the culprit, to name it
                if type(c) is not int or not 0 <= c <= MAX_BLOCK_COUNT:
                    _int(c, f"{at}[2][{j}] (count)", 0, MAX_BLOCK_COUNT)
        if not (packed[0] and packed[-1]):  # stored trimmed to the non-zero span
            first = next((j for j, c in enumerate(packed) if c), None)
            if first is None:  # an all-zero entry says nothing: nothing is stored for it
                continue
            last = max(j for j, c in enumerate(packed) if c)
            packed, lo = packed[first : last + 1], lo + first
        out.append(HistEntry(tensor, lo, packed.tobytes()))
    return out


def pack_counts(counts: np.ndarray, level: int) -> bytes:
    """The stored counts: uint32 for a step's own histogram (level 1), uint64 for a sum over steps."""
    return np.ascontiguousarray(counts, dtype=_U4 if level == 1 else _U8).tobytes()


def unpack_counts(blob: bytes, level: int) -> np.ndarray:
    """Inverse of `pack_counts`, as uint64."""
    return np.frombuffer(blob, dtype=_U4 if level == 1 else _U8).astype(np.uint64)


def hist_rows(run_id: int, hists: dict[int, list[HistEntry]], steps: np.ndarray) -> list[dict[str, Any]]:
    """Insert parameters of the histograms of `steps` (those newly stored), from `hists` by step."""
    return [
        {
            "run_id": run_id,
            "tensor": e.tensor,
            "level": 1,
            "step": s,
            "lo": e.lo,
            "n_steps": 1,
            "counts": e.counts,
        }
        for s in steps.tolist()
        for e in hists.get(s, ())
    ]


def _add_into(acc: dict[tuple, np.ndarray], key: tuple, lo: int, counts: np.ndarray) -> None:
    """Sum `counts` (from biased exponent `lo`) into the 256-bin histogram of `key`."""
    full = acc.get(key)
    if full is None:
        full = acc[key] = np.zeros(BLOCK_HIST_BINS, dtype=np.uint64)
    full[lo : lo + len(counts)] += counts


def _trimmed(full: np.ndarray) -> tuple[int, np.ndarray]:
    nz = np.flatnonzero(full)
    return int(nz[0]), full[nz[0] : nz[-1] + 1]


def compact_histograms(session: Session, run_id: int, cut: int) -> int:
    """Replace the per-step histograms of the steps before `cut` (a multiple of `COMPACT_BLOCK`) by their
    sums per tensor and block of `COMPACT_BLOCK` steps, merged into any such sum already stored (steps
    arriving late, below an earlier cut). Runs in the caller's write transaction; returns the rows dropped."""
    rows = session.execute(
        select(BlockHistogram.tensor, BlockHistogram.step, BlockHistogram.lo, BlockHistogram.counts).where(
            BlockHistogram.run_id == run_id, BlockHistogram.level == 1, BlockHistogram.step < cut
        )
    ).all()
    if not rows:
        return 0
    _merge_histograms(
        session, run_id, COMPACT_BLOCK, [(r.step, HistEntry(r.tensor, r.lo, r.counts)) for r in rows]
    )
    result = session.execute(
        delete(BlockHistogram).where(
            BlockHistogram.run_id == run_id, BlockHistogram.level == 1, BlockHistogram.step < cut
        )
    )
    return result.rowcount


#: the levels of the histogram sums written at ingest (`update_histogram_sums`): sealed as the heatmap's
#: rollups are, each from the level beneath it (the 8-step sums are compaction's, not sealed)
HIST_LEVELS: tuple[int, ...] = tuple(lv for lv in LEVELS if lv > COMPACT_BLOCK)


def _children(level: int) -> tuple[int, ...]:
    """The stored levels a block of `level` is summed from: the steps' own rows and compaction's 8-step sums
    (disjoint: compaction moves a step from one to the other) beneath the first level, the level below
    otherwise."""
    i = HIST_LEVELS.index(level)
    return (1, COMPACT_BLOCK) if i == 0 else (HIST_LEVELS[i - 1],)


def _sum_rows(rows: list, group: np.ndarray, n_groups: int) -> np.ndarray:
    """(n_groups, 256) uint64: each row's counts (``level``, ``lo``, ``counts``) added to its group's."""
    matrix = np.zeros((n_groups, BLOCK_HIST_BINS), dtype=np.uint64)
    for wide in {r.level != 1 for r in rows}:  # a step's own counts are uint32, every sum's uint64
        mine = [k for k, r in enumerate(rows) if (r.level != 1) == wide]
        values = unpack_counts(b"".join(rows[k].counts for k in mine), COMPACT_BLOCK if wide else 1)
        width = 8 if wide else 4
        lengths = np.fromiter((len(rows[k].counts) // width for k in mine), np.int64, len(mine))
        los = np.fromiter((rows[k].lo for k in mine), np.int64, len(mine))
        first = np.cumsum(lengths) - lengths
        exponent = np.repeat(los - first, lengths) + np.arange(len(values))
        np.add.at(matrix, (np.repeat(group[mine], lengths), exponent), values)
    return matrix


def _seal_histograms(
    session: Session, run_id: int, level: int, first: int, last: int, tensors: range
) -> None:
    """Write the sums of the blocks [first, last] of `level`, per tensor, from the levels beneath them (a row
    already there, for a block then still open, is replaced)."""
    lo, hi = first * level, (last + 1) * level - 1
    where = (
        BlockHistogram.run_id == run_id,
        # every tensor named: the primary key's (tensor, level, step) order is probed, not the run scanned
        BlockHistogram.tensor.in_(list(tensors)),
        BlockHistogram.level.in_(_children(level)),
        BlockHistogram.step.between(lo, hi),
    )
    rows = session.execute(
        select(
            BlockHistogram.tensor,
            BlockHistogram.level,
            BlockHistogram.step,
            BlockHistogram.lo,
            BlockHistogram.n_steps,
            BlockHistogram.counts,
        ).where(*where)
    ).all()
    if not rows:
        return
    keys = np.fromiter(((r.tensor << 40) | (r.step // level) for r in rows), np.int64, len(rows))
    groups, group = np.unique(keys, return_inverse=True)
    sums = _sum_rows(rows, group, len(groups))
    n_steps = np.zeros(len(groups), dtype=np.int64)
    np.add.at(n_steps, group, np.fromiter((r.n_steps for r in rows), np.int64, len(rows)))
    inserts = []
    for j, key in enumerate(groups.tolist()):
        span_lo, counts = _trimmed(sums[j])
        inserts.append(
            {
                "run_id": run_id,
                "tensor": key >> 40,
                "level": level,
                "step": (key & (2**40 - 1)) * level,
                "lo": span_lo,
                "n_steps": int(n_steps[j]),
                "counts": pack_counts(counts, level),
            }
        )
    session.execute(
        delete(BlockHistogram).where(
            BlockHistogram.run_id == run_id,
            BlockHistogram.tensor.in_(list(tensors)),
            BlockHistogram.level == level,
            BlockHistogram.step.between(lo, hi),
        )
    )
    session.execute(insert(BlockHistogram), inserts)


def _merge_histograms(
    session: Session, run_id: int, level: int, entries: list[tuple[int, HistEntry]]
) -> None:
    """Add steps' histograms ((step, entry)) into the sums of `level` their steps fall in (late steps into
    sealed sums; compaction's steps into the 8-step sums): read the touched rows once, add, write back (a
    block that held no histogram of the tensor gets its row)."""
    sums: dict[tuple[int, int], np.ndarray] = {}
    n_steps: dict[tuple[int, int], int] = {}
    for step, e in entries:
        key = (e.tensor, step // level * level)
        _add_into(sums, key, e.lo, unpack_counts(e.counts, 1))
        n_steps[key] = n_steps.get(key, 0) + 1
    tensors = sorted({t for t, _ in sums})
    starts = [s for _, s in sums]
    existing = {
        (r.tensor, r.step): r
        for r in session.execute(
            select(
                BlockHistogram.tensor,
                BlockHistogram.step,
                BlockHistogram.lo,
                BlockHistogram.n_steps,
                BlockHistogram.counts,
            ).where(
                BlockHistogram.run_id == run_id,
                BlockHistogram.tensor.in_(tensors),
                BlockHistogram.level == level,
                BlockHistogram.step.between(min(starts), max(starts)),
            )
        )
    }
    inserts, updates = [], []
    for key, full in sums.items():
        old = existing.get(key)
        if old is not None:
            _add_into(sums, key, old.lo, unpack_counts(old.counts, level))
        span_lo, counts = _trimmed(full)
        row = {
            "run_id": run_id,
            "tensor": key[0],
            "level": level,
            "step": key[1],
            "lo": span_lo,
            "n_steps": n_steps[key] + (old.n_steps if old is not None else 0),
            "counts": pack_counts(counts, level),
        }
        (updates if old is not None else inserts).append(row)
    if inserts:
        session.execute(insert(BlockHistogram), inserts)
    if updates:
        session.execute(update(BlockHistogram), updates)


def update_histogram_sums(
    session: Session,
    run_id: int,
    num_tensors: int,
    hists: dict[int, list[HistEntry]],
    steps: np.ndarray,
    last_before: int | None,
    last_after: int,
) -> None:
    """Keep the histogram sums of `HIST_LEVELS` up to date after storing new steps (ascending, not stored
    before; `hists` by step, those that sent some), as `rollups.update_rollups` does the heatmap's.

    A block of a level is written once the run's last step has moved past it (**sealed**), summed from the
    level beneath it; the block the run is in has no row yet and is read from the finer levels
    (`read_histogram`). A step that arrives late, into a sealed block, is added into that block's sum at
    every level where the block is sealed. The caller holds the run's write lock (no race on a seal or a
    merge), and has stored the steps' own rows already.
    """
    for level, late in late_steps(HIST_LEVELS, steps, last_before) if hists else ():
        entries = [(s, e) for s in steps[late].tolist() for e in hists.get(s, ())]
        if entries:  # late steps without histograms add nothing
            _merge_histograms(session, run_id, level, entries)
    for level, first, last in sealed_blocks(HIST_LEVELS, steps, last_before, last_after):
        _seal_histograms(session, run_id, level, first, last, range(num_tensors))


@dataclass
class BucketedHistogram:
    """A tensor's histograms summed over aligned buckets of `width` steps (only the buckets holding one)."""

    width: int
    starts: list[int]
    ends: list[int]
    steps: list[int]  # steps (with a histogram) summed into each bucket
    lo: int | None  # biased exponent of counts[:, 0]; None when no bucket
    counts: np.ndarray  # (buckets, exponents) uint64


def read_histogram(
    session: Session, run_id: int, tensor: int, lo: int, hi: int, max_steps: int
) -> BucketedHistogram:
    """Tensor `tensor`'s histograms over steps [lo, hi], summed per aligned bucket of steps, at most
    `max_steps` buckets; a range reaching into compacted steps is bucketed no finer than their blocks.

    Each bucket is read from the coarsest sums that fit it (`HIST_LEVELS`, sealed blocks only: `cover`),
    the rest (the range's ends, the block the run is in) from the steps' own rows and the 8-step sums.
    Memory: the rows read (about max_steps of them, plus two coarse blocks' worth at each end) and the
    answer."""
    compacted = session.scalar(
        select(func.max(BlockHistogram.step)).where(
            BlockHistogram.run_id == run_id,
            BlockHistogram.tensor == tensor,
            BlockHistogram.level == COMPACT_BLOCK,
            BlockHistogram.step <= hi,
        )
    )
    reaches_compacted = compacted is not None and compacted + COMPACT_BLOCK > lo
    plan = plan_heatmap(lo, hi, max_steps, COMPACT_BLOCK if reaches_compacted else 1)
    last_step = session.scalar(select(Run.last_step).where(Run.id == run_id))
    usable = [lv for lv in reversed(HIST_LEVELS) if lv <= plan.level]
    columns = (
        BlockHistogram.level,
        BlockHistogram.step,
        BlockHistogram.lo,
        BlockHistogram.n_steps,
        BlockHistogram.counts,
    )
    mine = (BlockHistogram.run_id == run_id, BlockHistogram.tensor == tensor)
    rows: list = []
    for level, first, last in cover(lo, hi, usable, last_step):
        if level != 1:
            rows += session.execute(
                select(*columns).where(
                    *mine,
                    BlockHistogram.level == level,
                    BlockHistogram.step.between(first * level, last * level),
                )
            ).all()
            continue
        # a compacted block that starts before the piece but reaches into it counts whole (only at `lo`:
        # every other piece starts on a coarse block's boundary)
        start = first // COMPACT_BLOCK * COMPACT_BLOCK if reaches_compacted else first
        piece = session.execute(
            select(*columns).where(
                *mine, BlockHistogram.level.in_((1, COMPACT_BLOCK)), BlockHistogram.step.between(start, last)
            )
        ).all()
        rows += [r for r in piece if r.level != 1 or r.step >= first]
    if not rows:
        return BucketedHistogram(plan.width, [], [], [], None, np.zeros((0, 0), dtype=np.uint64))
    # one pass in numpy over all the rows' counts: each count lands in (its row's bucket, its exponent)
    row_bucket = np.fromiter((r.step // plan.width for r in rows), np.int64, len(rows))
    buckets, row_col = np.unique(row_bucket, return_inverse=True)
    n_steps = np.zeros(len(buckets), dtype=np.int64)
    np.add.at(n_steps, row_col, np.fromiter((r.n_steps for r in rows), np.int64, len(rows)))
    matrix = _sum_rows(rows, row_col, len(buckets))
    nz = np.flatnonzero(matrix.any(axis=0))
    first_e, last_e = int(nz[0]), int(nz[-1])
    return BucketedHistogram(
        width=plan.width,
        starts=[max(b * plan.width, lo) for b in buckets.tolist()],
        ends=[min((b + 1) * plan.width - 1, hi) for b in buckets.tolist()],
        steps=n_steps.tolist(),
        lo=first_e,
        counts=matrix[:, first_e : last_e + 1],
    )


def latest_block_stats(
    session: Session, run_id: int, num_tensors: int
) -> tuple[int, dict[str, np.ndarray]] | None:
    """The block columns of the run's latest step that carried them: (step, column -> (T,)), or None when
    the run never sent them (`blocks_zero` absent where an older sender left it out)."""
    names = ("blocks", "blocks_at_limit", "block_range", "blocks_zero")
    ids = [STAT_IDS[c] for c in names]
    last = session.scalar(
        select(func.max(StepStat.step)).where(StepStat.run_id == run_id, StepStat.metric == ids[2])
    )
    if last is None:
        return None
    _, matrices = read_step_stats_each(session, run_id, ids, int(last), int(last), num_tensors)
    if not all(i in matrices for i in ids[:3]):
        return None
    return int(last), {c: matrices[i][0] for c, i in zip(names, ids, strict=True) if i in matrices}


def add_block_health(layers: list[dict[str, Any]], latest: tuple[int, dict[str, np.ndarray]] | None) -> None:
    """Fill the layers table's block fields in place from `latest_block_stats`: per tensor its block range,
    its share of blocks at a scale limit and its share of all-zero blocks (kept apart: sparsity is no fault),
    per layer the worst of its tensors (None without block columns)."""
    if latest is None:
        return
    _, cols = latest
    shares = {"block_at_limit": block_fraction(cols["blocks_at_limit"], cols["blocks"])}
    if "blocks_zero" in cols:
        shares["block_zero"] = block_fraction(cols["blocks_zero"], cols["blocks"])
    for layer in layers:
        ranges = []
        worst: dict[str, list[float]] = {key: [] for key in shares}
        for t in layer["tensors"]:
            i = t["index"]
            t["block_range"] = encode_float(cols["block_range"][i])
            ranges.append(cols["block_range"][i])
            for key, share in shares.items():
                t[key] = encode_float(share[i])
                worst[key].append(share[i])
        # NaN-propagating, as every worst-of here: a NaN range shows
        layer["block_range"] = encode_float(np.max(ranges)) if ranges else None
        for key, values in worst.items():
            layer[key] = encode_float(np.max(values)) if values else None
