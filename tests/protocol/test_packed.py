"""The packed matrix answer (`fp8_protocol.packed`): the layout the service writes and the clients read."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest

from fp8_protocol.packed import pack_matrix, unpack_matrix


@pytest.mark.parametrize(("rows", "cols", "extra"), [(0, 0, ""), (3, 5, ""), (2, 1, "x"), (7, 3, "xyz" * 11)])
def test_header_and_matrix_come_back_with_the_matrix_aligned_to_eight(rows, cols, extra):
    matrix = np.arange(rows * cols, dtype=np.float64).reshape(rows, cols) / 3
    if matrix.size:
        matrix.flat[:3] = [math.nan, math.inf, -math.inf][: matrix.size]
    header = json.dumps({"rows": rows, "cols": cols, "dtype": "float64", "name": extra}).encode()
    body = pack_matrix(header, matrix)
    # the layout itself: uint32 N little-endian, the header, zeros up to a multiple of 8, the float64 cells
    (n,) = struct.unpack("<I", body[:4])
    assert body[4 : 4 + n] == header
    offset = len(body) - matrix.size * 8
    assert offset % 8 == 0 and 0 <= offset - (4 + n) < 8 and set(body[4 + n : offset]) <= {0}
    assert np.array_equal(np.frombuffer(body[offset:], "<f8").reshape(rows, cols), matrix, equal_nan=True)
    head, back = unpack_matrix(body)
    assert head == json.loads(header)
    assert np.array_equal(back, matrix, equal_nan=True) and back.flags.writeable
