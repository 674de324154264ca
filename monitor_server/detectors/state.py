"""JSON encoding of detector state (evidence, JSON-safe, comes from `fp8_protocol.codec.jsonable`).

Small 1-D arrays become lists (non-finite floats spelled "NaN" / "Infinity" / "-Infinity" by `encode_float`);
larger ones a base64 envelope ``{"dtype": "<f8", "shape": [...], "b64": "..."}`` of their little-endian
bytes (bool arrays bit-packed), which keeps every value, NaN and ±inf included, bit for bit, and keeps the
state of a 512-tensor run at a few hundred kB that encodes in about a millisecond: the API layer
persists it after every batch.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from fp8_protocol.codec import decode_float, encode_float

LIST_MAX = 32  # 1-D arrays up to this many elements stay readable lists


def encode_array(a: np.ndarray) -> list | dict[str, Any]:
    """An array as JSON: a list when 1-D and small, else a base64 envelope."""
    a = np.asarray(a)
    if a.ndim <= 1 and a.size <= LIST_MAX:
        if a.dtype.kind != "f" or np.isfinite(a).all():
            return a.tolist()
        flat = [encode_float(x) for x in a.ravel().tolist()]
        return flat
    if a.dtype == bool:
        raw, dtype = np.packbits(a.ravel()).tobytes(), "bool"
    else:
        le = a.astype(a.dtype.newbyteorder("<"), copy=False)
        raw, dtype = np.ascontiguousarray(le).tobytes(), le.dtype.str
    return {"dtype": dtype, "shape": list(a.shape), "b64": base64.b64encode(raw).decode("ascii")}


def decode_array(obj: Any, dtype: Any) -> np.ndarray:
    """Inverse of `encode_array`, converted to `dtype`."""
    if isinstance(obj, dict):
        raw = base64.b64decode(obj["b64"])
        shape = tuple(obj["shape"])
        if obj["dtype"] == "bool":
            flat = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=int(np.prod(shape))).astype(bool)
        else:
            flat = np.frombuffer(raw, dtype=np.dtype(obj["dtype"]))
        return flat.reshape(shape).astype(dtype)  # astype copies: the result is writable
    if np.dtype(dtype).kind != "f":
        return np.asarray(obj, dtype=dtype)
    raw_list = np.asarray(obj, dtype=object)
    flat = [decode_float(x, null_as_nan=True) for x in raw_list.ravel().tolist()]
    return np.asarray(flat, dtype=dtype).reshape(raw_list.shape)
