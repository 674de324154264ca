"""the block histograms' coarse sums (64, 512 and 4096 steps) of the blocks the runs stored so far have
already moved past: from this revision on the service writes them at ingest as each block is sealed and
reads sealed blocks from them only, so the histograms stored before it get theirs here

No schema change: rows of `block_histograms` at levels 64, 512 and 4096. Self-contained (this file does not
follow later changes to the service's code): a sum is the element-wise sum of the counts beneath it, stored
as little-endian uint64 trimmed to its non-zero span, `step` the block's first step.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 10:00:00.000000
"""

from __future__ import annotations

import numpy as np
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

LEVELS = (64, 512, 4096)
BINS = 256

_hist = sa.table(
    "block_histograms",
    sa.column("run_id", sa.Integer),
    sa.column("tensor", sa.Integer),
    sa.column("level", sa.SmallInteger),
    sa.column("step", sa.BigInteger),
    sa.column("lo", sa.SmallInteger),
    sa.column("n_steps", sa.Integer),
    sa.column("counts", sa.LargeBinary),
)


def _sums(rows, level: int) -> dict[int, tuple[np.ndarray, int]]:
    """block start -> (256 uint64 counts, steps) of `rows` ((step, lo, n_steps, counts as uint64))."""
    out: dict[int, tuple[np.ndarray, int]] = {}
    for step, lo, n_steps, counts in rows:
        start = step // level * level
        full, n = out.get(start, (None, 0))
        if full is None:
            full = np.zeros(BINS, dtype=np.uint64)
        full[lo : lo + len(counts)] += counts
        out[start] = (full, n + n_steps)
    return out


def upgrade() -> None:
    bind = op.get_bind()
    runs = bind.execute(sa.text("SELECT id, last_step FROM runs WHERE last_step IS NOT NULL")).all()
    for run_id, last_step in runs:
        tensors = bind.execute(sa.select(_hist.c.tensor).where(_hist.c.run_id == run_id).distinct()).scalars()
        for tensor in list(tensors):
            # the steps' own rows (uint32) and compaction's 8-step sums (uint64) below the first open block
            sealed_end = int(last_step) // LEVELS[0] * LEVELS[0]
            stored = bind.execute(
                sa.select(_hist.c.level, _hist.c.step, _hist.c.lo, _hist.c.n_steps, _hist.c.counts).where(
                    _hist.c.run_id == run_id,
                    _hist.c.tensor == tensor,
                    _hist.c.level.in_((1, 8)),
                    _hist.c.step < sealed_end,
                )
            ).all()
            rows = [
                (
                    r.step,
                    r.lo,
                    r.n_steps,
                    np.frombuffer(r.counts, "<u4" if r.level == 1 else "<u8").astype(np.uint64),
                )
                for r in stored
            ]
            inserts = []
            for level in LEVELS:
                sealed_end = int(last_step) // level * level
                sums = _sums([r for r in rows if r[0] < sealed_end], level)
                rows = []
                for start, (full, n_steps) in sorted(sums.items()):
                    nz = np.flatnonzero(full)
                    if not len(nz):
                        continue
                    counts = full[nz[0] : nz[-1] + 1]
                    rows.append((start, int(nz[0]), n_steps, counts))
                    inserts.append(
                        {
                            "run_id": run_id,
                            "tensor": tensor,
                            "level": level,
                            "step": start,
                            "lo": int(nz[0]),
                            "n_steps": n_steps,
                            "counts": counts.astype("<u8").tobytes(),
                        }
                    )
            bind.execute(
                sa.delete(_hist).where(
                    _hist.c.run_id == run_id, _hist.c.tensor == tensor, _hist.c.level.in_(LEVELS)
                )
            )
            if inserts:
                bind.execute(sa.insert(_hist), inserts)


def downgrade() -> None:
    op.execute(sa.delete(_hist).where(_hist.c.level.in_(LEVELS)))
