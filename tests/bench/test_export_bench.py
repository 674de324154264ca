"""bench/export.py on a run of 510 tensors x 2,000 steps: the export streams, so the server's peak memory
grows by far less than the file it sends (the whole long table would be 66 MB in Arrow, 93 MB as CSV)."""

import pytest

from bench import export as export_bench  # not bench/ on sys.path: its kernels.py would shadow a package


@pytest.mark.slow
def test_long_export_memory_stays_bounded(tmp_path):
    out = tmp_path / "export.json"
    result = export_bench.main(["--steps", "2000", "--cases", "long", "--out", str(out)])
    assert out.exists() and result["meta"]["long_rows"] == 510 * 2000
    rows = {r["format"]: r for r in result["rows"]}
    assert set(rows) == {"csv", "parquet"}
    assert rows["csv"]["mb"] > 90  # the whole table really went out
    for fmt, row in rows.items():
        # building the table whole would need its Arrow form (66 MB) and, for CSV, its 93 MB of text
        assert row["peak_growth_mb"] < 45, (fmt, row)
