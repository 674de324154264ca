"""The statistic columns and the FP8 constants both sides read from `fp8_protocol.stats`."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fp8_protocol import stats


def test_a_row_is_the_base_then_the_quality_columns_at_the_named_positions():
    assert stats.BASE_COLUMNS == ("amax", "scale", "overflow", "underflow", "nonfinite", "numel")
    assert stats.QUALITY_COLUMNS == ("sum_sq", "err_sq", "subnormal", "min_abs")
    assert stats.STAT_COLUMNS == stats.BASE_COLUMNS + stats.QUALITY_COLUMNS
    named = {
        "amax": stats.AMAX,
        "scale": stats.SCALE,
        "overflow": stats.OVERFLOW,
        "underflow": stats.UNDERFLOW,
        "nonfinite": stats.NONFINITE,
        "numel": stats.NUMEL,
        "sum_sq": stats.SUM_SQ,
        "err_sq": stats.ERR_SQ,
        "subnormal": stats.SUBNORMAL,
        "min_abs": stats.MIN_ABS,
    }
    assert {name: stats.STAT_COLUMNS[i] for name, i in named.items()} == {n: n for n in named}


def test_block_columns_an_older_sender_leaves_out_only_the_last():
    assert len(stats.BLOCK_COLUMNS) == 6 and stats.BLOCK_COLUMNS[-1] == "blocks_zero"
    assert stats.BLOCK_COLUMNS[:5] == stats.LEGACY_BLOCK_COLUMNS
    assert not set(stats.BLOCK_COLUMNS) & set(stats.STAT_COLUMNS)


def test_every_column_merges_one_known_way_and_counts_are_columns():
    every = stats.STAT_COLUMNS + stats.BLOCK_COLUMNS
    assert set(stats.MERGE) == set(every) and set(stats.MERGE.values()) <= {"max", "min", "sum"}
    assert set(every) >= stats.COUNT_COLUMNS
    assert "block_range" not in stats.COUNT_COLUMNS and "amax" not in stats.COUNT_COLUMNS
    # a count adds up over ranks and micro-steps
    assert {stats.MERGE[c] for c in stats.COUNT_COLUMNS} == {"sum"}


def test_fp8_limits_are_the_formats_own():
    assert stats.FP8_MAX == {"e4m3": 448.0, "e5m2": 57344.0}
    assert stats.FP8_MIN_NORMAL == {"e4m3": 2.0**-6, "e5m2": 2.0**-14}
    assert stats.FP8_MIN_SUBNORMAL == {"e4m3": 2.0**-9, "e5m2": 2.0**-16}
    assert stats.FP8_RANGE_BINADES["e4m3"] == pytest.approx(17.807, abs=1e-3)
    assert stats.FP8_RANGE_BINADES["e5m2"] == pytest.approx(31.807, abs=1e-3)


def test_stored_amax_is_nan_only_for_a_tensor_with_no_finite_element():
    amax = np.array([0.0, 0.0, 3.0, math.inf, 0.0])
    numel = np.array([4, 4, 4, 4, 0])
    nonfinite = np.array([4, 0, 2, 4, 0])
    out = stats.stored_amax(amax, numel, nonfinite)
    assert np.isnan(out[0])
    assert out[1:].tolist() == [0.0, 3.0, math.inf, 0.0]


def test_sqnr_is_inf_for_an_exact_round_trip_and_nan_without_a_finite_element():
    assert stats.sqnr_db(100.0, 1.0) == pytest.approx(20.0)
    assert stats.sqnr_db(0.0, 0.0) == math.inf
    assert math.isnan(stats.sqnr_db(0.0, 0.0, numel=8, nonfinite=8))
    assert stats.sqnr_db(0.0, 0.0, numel=8, nonfinite=0) == math.inf


def test_quality_quantities_take_their_neutral_value_where_there_is_nothing_to_measure():
    assert stats.outlier_ratio(0.0, 0.0, 4, 0) == 1.0
    assert stats.outlier_ratio(4.0, 16.0, 4, 0) == pytest.approx(2.0)  # rms 2
    assert stats.dynamic_range(8.0, math.inf) == 0.0
    assert stats.dynamic_range(8.0, 0.5) == pytest.approx(4.0)
    assert stats.subnormal_fraction(3, 0) == 0.0 and stats.subnormal_fraction(3, 12) == 0.25
    assert stats.block_fraction(1, 0) == 0.0 and stats.block_fraction(1, 4) == 0.25
    assert np.isnan(stats.rms(0.0, 2, 2)) and stats.rms(12.0, 4, 1) == 2.0
