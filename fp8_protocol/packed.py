"""The packed matrix answer (``GET /runs/{id}/heatmap/packed``): a JSON header and a float64 matrix in one
binary body, so a 512-tensor heatmap is not spelled out as JSON numbers.

Layout: a little-endian uint32 N; N bytes of a JSON object (the header, which holds at least ``rows``,
``cols`` and ``dtype`` ``"float64"``); zero bytes up to a multiple of 8 (so the matrix can be viewed in
place, as the dashboard's ``Float64Array`` does); then rows x cols little-endian float64 in row-major order,
NaN and infinities native. The service writes it (`pack_matrix`); the read client (`unpack_matrix`) and
`web/js/heatmapdata.js` read it.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

#: The header length's encoding, and the alignment of the matrix after the header.
HEADER_LENGTH = struct.Struct("<I")
MATRIX_ALIGN = 8


def pack_matrix(header: bytes, matrix: np.ndarray) -> bytes:
    """The packed body of `header` (JSON bytes, already holding ``rows``, ``cols`` and ``dtype``) and the
    (rows, cols) `matrix` as little-endian float64."""
    values = np.ascontiguousarray(matrix, dtype="<f8")
    pad = -(HEADER_LENGTH.size + len(header)) % MATRIX_ALIGN
    return HEADER_LENGTH.pack(len(header)) + header + b"\0" * pad + values.tobytes()


def unpack_matrix(blob: bytes) -> tuple[dict[str, Any], np.ndarray]:
    """The header and the (rows, cols) float64 matrix (a writable copy) of a packed body."""
    (n,) = HEADER_LENGTH.unpack_from(blob)
    head = json.loads(blob[HEADER_LENGTH.size : HEADER_LENGTH.size + n])
    offset = -(-(HEADER_LENGTH.size + n) // MATRIX_ALIGN) * MATRIX_ALIGN
    values = np.frombuffer(blob, "<f8", count=head["rows"] * head["cols"], offset=offset)
    return head, values.reshape(head["rows"], head["cols"]).copy()
