"""How values travel in JSON between the training client, the service and the dashboard.

JSON has no NaN or infinity, so a float that may be non-finite is a JSON number or one of the strings
"NaN", "Infinity", "-Infinity" (`NONFINITE_SPELLING`). A statistic column (one value per tensor) is either
a JSON array of such floats or a packed column ``{"dtype": "float32"|"float64", "b64": "<base64
little-endian>"}`` (`pack_column` writes one, `decode_column` reads either). See docs/wire-format.md.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable
from typing import Any

import numpy as np

#: How JSON spells the non-finite floats (JSON itself has no NaN or Infinity).
NONFINITE_SPELLING: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
#: The dtypes a packed column may hold, little-endian.
PACKED_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}


class WireError(ValueError):
    """A value that does not follow the wire format; the message names where and the problem."""


def encode_float(x: float) -> float | str:
    """A float as JSON can carry it: finite unchanged, NaN / ±inf as "NaN" / "Infinity" / "-Infinity"."""
    x = float(x)
    if math.isfinite(x):
        return x
    if x != x:
        return "NaN"
    return "Infinity" if x > 0 else "-Infinity"


def decode_float(value: Any, where: str = "value", *, null_as_nan: bool = False) -> float:
    """One wire float, the inverse of `encode_float`: a JSON number or one of the three non-finite strings.

    Args:
        where: names the value in the error.
        null_as_nan: take None (JSON null) as NaN instead of refusing it.

    Raises:
        WireError: a boolean, another string, or anything that is not a number.
    """
    if value is None and null_as_nan:
        return math.nan
    if isinstance(value, bool):
        raise WireError(f"{where}: expected a number, got a boolean")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value in NONFINITE_SPELLING:
        return NONFINITE_SPELLING[value]
    raise WireError(f"{where}: expected a number or one of 'NaN', 'Infinity', '-Infinity', got {value!r:.40}")


def jsonable(value: Any, other: Callable[[Any], Any] | None = None) -> Any:
    """`value` as JSON can carry it: every non-finite float spelled (`encode_float`), also inside dicts,
    lists, tuples and numpy arrays; numpy scalars and arrays as Python numbers and lists; keys as strings.

    Args:
        other: what becomes of a value of any other type (a Path, an object): None keeps it as it is (the
            caller's encoder then decides), a callable converts it (the client passes ``str``).
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return encode_float(float(value))
    if isinstance(value, dict):
        return {str(k): jsonable(v, other) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v, other) for v in value]
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biu" or (value.dtype.kind == "f" and np.isfinite(value).all()):
            return value.tolist()  # nothing to spell out: skip the per-element walk
        return jsonable(value.tolist(), other)
    return value if other is None else other(value)


def pack_column(values: np.ndarray) -> dict[str, str]:
    """A packed column: float32 when that is exact for every value, float64 otherwise."""
    v = np.ascontiguousarray(values, dtype="<f8")
    f32 = v.astype("<f4")
    with np.errstate(invalid="ignore"):
        exact = np.array_equal(f32.astype("<f8"), v, equal_nan=True)
    data, dtype = (f32, "float32") if exact else (v, "float64")
    return {"dtype": dtype, "b64": base64.b64encode(data.tobytes()).decode("ascii")}


def decode_column(value: Any, length: int, where: str) -> np.ndarray:
    """Decode one column, a JSON array or a packed column, into a float64 array of `length` values.

    Raises:
        WireError: wrong length, wrong dtype, bad base64 or a non-number element.
    """
    if isinstance(value, dict):
        dtype = PACKED_DTYPES.get(value.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise WireError(
                f"{where}: packed column dtype must be 'float32' or 'float64', got {value.get('dtype')!r}"
            )
        b64 = value.get("b64")
        if not isinstance(b64, str) or set(value) != {"dtype", "b64"}:
            raise WireError(f"{where}: packed column must be exactly {{'dtype': ..., 'b64': '<base64>'}}")
        try:
            raw = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise WireError(f"{where}: invalid base64 ({exc})") from None
        if len(raw) != length * dtype.itemsize:
            held = len(raw) / dtype.itemsize
            raise WireError(
                f"{where}: packed column holds {held:g} {dtype.name} values, "
                f"expected {length} (one per tensor)"
            )
        return np.frombuffer(raw, dtype=dtype).astype(np.float64)
    if isinstance(value, list):
        if len(value) != length:
            raise WireError(f"{where}: column has {len(value)} values, expected {length} (one per tensor)")
        arr = np.array(value) if value else np.zeros(0)
        if arr.dtype.kind in "fi" and arr.ndim == 1 and not any(v is True or v is False for v in value):
            return arr.astype(np.float64, copy=False)
        # mixed numbers and non-finite strings (or garbage): the careful path
        return np.array([decode_float(v, f"{where}[{i}]") for i, v in enumerate(value)], dtype=np.float64)
    raise WireError(f"{where}: expected a JSON array or a packed column object, got {type(value).__name__}")
