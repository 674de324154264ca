"""A real run gone NaN, exported and read as a pandas user reads it: the largest amax of a step where every
tensor is all NaN is NaN, not the 0 of an amax that ignores NaN; the counts are integers."""

from __future__ import annotations

import io

import pandas as pd
import pytest

from fp8_trainer.monitor.read import Reader
from tests.e2e.e2e_utils import run_by_name

pytestmark = pytest.mark.slow


def test_a_run_gone_nan_exports_no_amax_of_zero(server, api, train):
    train("--steps", "14", "--monitor-url", server.url, "--run-name", "e2e-nan-export",
          "--inject", "nan:blocks.1.mlp.fc@12")  # fmt: skip
    run = run_by_name(api, "e2e-nan-export")
    with Reader(server.url, format="parquet") as reader:
        frame = reader.frame(run["id"], "stats")
    body = api.get(f"/runs/{run['id']}/export", params={"format": "csv"}).text
    for df in (frame, pd.read_csv(io.StringIO(body))):
        gone = (df["nonfinite"] == df["numel"]).groupby(df["step"]).all()  # every tensor all NaN
        # the NaN spreads to every tensor within a step or two of the injection; none before it
        assert not gone.loc[:11].any() and gone.loc[13:].all(), gone
        top = df.groupby("step")["amax"].max()  # pandas skips NaN: NaN only where every tensor has none
        assert (top.loc[:11] > 0).all(), top
        assert top.loc[gone].isna().all(), top  # not 0: no tensor had an amax there
    # Parquet keeps the counts integers
    assert {str(frame[c].dtype) for c in ("overflow", "underflow", "nonfinite", "numel", "subnormal")} == {
        "int64"
    }
