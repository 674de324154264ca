"""``bench/block_host.py --smoke``: the script runs and its launch counts are the ones
``tests/trainer/test_block_launch_budget.py`` holds (its host times are not measurements in a smoke run)."""

import json
import os
import subprocess
import sys

import pytest

from fp8_kernels import triton_available
from tests.support import ROOT
from tests.trainer.test_block_launch_budget import BLOCK_LAYER, MXFP8_LAYER


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install .[dev])")
def test_block_host_smoke(tmp_path):
    out = tmp_path / "block_host.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "block_host.py"), "--smoke", "--out", str(out)],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    data = json.loads(out.read_text())
    assert data["meta"]["smoke"] is True and data["summary"]
    rows = {r["layer"]: r for r in data["rows"]}
    assert list(rows) == ["bf16", "delayed", "mxfp8", "mxfp8 eager stats", "block", "block eager stats"]
    assert rows["mxfp8"]["launches_per_layer"] == sum(MXFP8_LAYER.values())
    assert rows["block"]["launches_per_layer"] == sum(BLOCK_LAYER.values())
    for name, row in rows.items():
        assert row["host_reads_per_layer"] == 0, name
    for kind in ("mxfp8", "block"):  # the eager fold: hundreds of launches more
        assert rows[f"{kind} eager stats"]["launches_per_layer"] > 8 * rows[kind]["launches_per_layer"]
    assert rows["bf16"]["ops_per_layer"] == {"addmm": 1, "mm": 2, "sum": 1}
