"""How a float that may be non-finite, a statistic column and any JSON value travel (`fp8_protocol.codec`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fp8_protocol.codec import (
    NONFINITE_SPELLING,
    WireError,
    decode_column,
    decode_float,
    encode_float,
    jsonable,
    pack_column,
)

FLOATS = [0.0, -0.0, 1.5, -3e38, 5e-324, 448, 2.0**-16, math.nan, math.inf, -math.inf]


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1.0, a) == math.copysign(1.0, b))


@pytest.mark.parametrize("x", FLOATS)
def test_a_float_survives_strict_json_and_comes_back(x):
    back = decode_float(json.loads(json.dumps(encode_float(x), allow_nan=False)))
    assert _same(back, float(x))


def test_the_three_non_finite_spellings_and_nothing_else():
    assert [encode_float(x) for x in (math.nan, math.inf, -math.inf)] == ["NaN", "Infinity", "-Infinity"]
    assert {k: str(v) for k, v in NONFINITE_SPELLING.items()} == {
        "NaN": "nan",
        "Infinity": "inf",
        "-Infinity": "-inf",
    }
    assert type(encode_float(3)) is float and type(encode_float(np.float32(0.5))) is float
    for bad in ("nan", "inf", "Inf", "", "1.0"):
        with pytest.raises(WireError, match=r"scalars\.loss: expected a number or one of"):
            decode_float(bad, "scalars.loss")


def test_decode_float_refuses_booleans_and_null_unless_null_is_asked_for_as_nan():
    with pytest.raises(WireError, match="got a boolean"):
        decode_float(True)
    with pytest.raises(WireError):
        decode_float(None)
    assert math.isnan(decode_float(None, null_as_nan=True))
    assert decode_float(7) == 7.0 and type(decode_float(7)) is float
    assert issubclass(WireError, ValueError)


def test_jsonable_spells_every_non_finite_float_however_deep_and_makes_numpy_plain():
    value = {
        1: [np.float32(np.inf), (np.nan, np.int64(3))],
        "arr": np.array([1.0, -np.inf]),
        "ints": np.arange(3, dtype=np.int16),
        "flag": np.bool_(True),
        "text": "NaN",
        "none": None,
    }
    out = jsonable(value)
    assert out == {
        "1": ["Infinity", ["NaN", 3]],
        "arr": [1.0, "-Infinity"],
        "ints": [0, 1, 2],
        "flag": True,
        "text": "NaN",
        "none": None,
    }
    assert type(out["1"][1][1]) is int and type(out["flag"]) is bool
    json.dumps(out, allow_nan=False)  # strict JSON takes it


def test_jsonable_keeps_or_converts_what_it_does_not_know():
    path = Path("/x/y")
    assert jsonable({"p": path})["p"] is path
    assert jsonable({"p": path, "v": [math.nan]}, other=str) == {"p": str(path), "v": ["NaN"]}


@pytest.mark.parametrize("n", [0, 4, 7])
def test_a_packed_column_round_trips_bit_for_bit_and_uses_float32_only_when_exact(n):
    rng = np.random.default_rng(n)
    exact = rng.integers(-1000, 1000, n).astype(np.float64)
    exact[: min(n, 3)] = [math.nan, math.inf, -math.inf][: min(n, 3)]
    inexact = exact + 0.1
    for values, dtype in ((exact, "float32"), (inexact, "float64" if n else "float32")):
        packed = pack_column(values)
        assert packed["dtype"] == dtype and set(packed) == {"dtype", "b64"}
        back = decode_column(json.loads(json.dumps(packed)), n, "stats.amax")
        assert back.dtype == np.float64
        assert np.array_equal(back, values, equal_nan=True)


def test_a_list_column_decodes_numbers_and_spellings():
    back = decode_column([1, 2.5, "NaN", "-Infinity"], 4, "c")
    assert np.array_equal(back, [1.0, 2.5, math.nan, -math.inf], equal_nan=True)
    assert decode_column([], 0, "c").shape == (0,)


@pytest.mark.parametrize(
    ("column", "message"),
    [
        ([1.0, 2.0], r"stats\.amax: column has 2 values, expected 3"),
        ([1.0, True, 2.0], r"stats\.amax\[1\]: expected a number, got a boolean"),
        ([1.0, "nan", 2.0], r"stats\.amax\[1\]: expected a number or one of"),
        ({"dtype": "float16", "b64": ""}, "dtype must be 'float32' or 'float64'"),
        ({"dtype": "float32", "b64": "!!"}, "invalid base64"),
        ({"dtype": "float32", "b64": "AAAA", "x": 1}, "must be exactly"),
        (pack_column(np.zeros(2)), r"holds 2 float32 values, expected 3"),
        ("1,2,3", "expected a JSON array or a packed column object, got str"),
    ],
)
def test_a_bad_column_is_refused_naming_where_and_why(column, message):
    with pytest.raises(WireError, match=message):
        decode_column(column, 3, "stats.amax")
