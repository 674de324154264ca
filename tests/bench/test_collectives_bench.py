"""``bench/collectives.py --smoke``: the script runs its two gloo ranks, counts every mode's collectives, and
the FP8 all-gather moves FP8 bytes (its step times are not measurements in a smoke run)."""

import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT


@pytest.mark.slow
def test_collectives_smoke(tmp_path):
    out = tmp_path / "collectives.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "collectives.py"), "--smoke", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert f"wrote {out}" in proc.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["smoke"] is True and data["summary"]
    rows = {r["mode"]: r for r in data["rows"]}
    assert list(rows)[:4] == ["bf16", "fp8scope hp-gather", "fp8scope delayed", "fp8scope current"]
    bf16 = rows["bf16"]["bytes_per_step"]
    assert bf16["all_gather"] > 0 and bf16["reduce_scatter"] > 0 and bf16["all_reduce"] == 0
    assert rows["fp8scope hp-gather"]["bytes_per_step"]["all_gather"] == bf16["all_gather"]
    for mode in ("fp8scope delayed", "fp8scope current"):
        r = rows[mode]
        assert "uint8" in r["dtypes"]["all_gather"]  # FP8 bytes (mixed with the bf16 embeddings: uint8)
        # the FP8 weights are most of the bytes: well under the bf16 run's, even with the embeddings in bf16
        assert r["bytes_per_step"]["all_gather"] < 0.6 * bf16["all_gather"]
        # the gradients stay high precision
        assert r["bytes_per_step"]["reduce_scatter"] == bf16["reduce_scatter"]
        assert r["bytes_per_step"]["stats_gather"] > 0  # the whole weights' statistics rows
    # current scaling reduces each weight's amax before its cast: more all-reduce calls than delayed
    assert (
        rows["fp8scope current"]["calls_per_step"]["all_reduce"]
        > rows["fp8scope delayed"]["calls_per_step"]["all_reduce"]
    )
    # a hung monitor: the same training (losses), its rank 0 never got an answer, the run did not wait on it
    hung = rows["fp8scope hung monitor"]
    assert hung["losses"] == rows["fp8scope delayed"]["losses"]
    assert hung["bytes_per_step"]["all_gather"] == rows["fp8scope delayed"]["bytes_per_step"]["all_gather"]
    assert any("hung monitor" in k for k in data["goals"])
    ao = rows["torchao float8"]
    assert "skipped" in ao or "uint8" in ao["dtypes"]["all_gather"]
