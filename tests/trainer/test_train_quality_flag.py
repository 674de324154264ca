"""`fp8-train --no-quality-stats`: the quantize pass leaves the quality columns out (6-column statistics), and
by default they are in (10 columns), as the statistics dump shows."""

import numpy as np
import pytest

from fp8_protocol.stats import BASE_COLUMNS, STAT_COLUMNS
from fp8_trainer.app import cli

pytestmark = pytest.mark.slow  # two tiny runs of four steps


@pytest.mark.parametrize(
    "flag,columns", [((), len(STAT_COLUMNS)), (("--no-quality-stats",), len(BASE_COLUMNS))]
)
def test_quality_stats_flag(tmp_path, flag, columns):
    dump = tmp_path / "stats.npz"
    args = [
        "--preset",
        "tiny",
        "--steps",
        "4",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--eval-interval",
        "0",
    ]
    code = cli.main([*args, "--no-progress", "--stats-dump", str(dump), *flag])
    assert code in (0, None)
    stats = np.load(dump)["stats"]
    assert stats.shape[0] == 4 and stats.shape[2] == columns
    assert np.isfinite(stats[:, :, 0]).all()  # the base columns are there either way
