"""The local spool: what the monitor could not deliver, in a file that ``fp8-monitor upload`` replays.

The file's records, their meaning and the replay are defined once, in the torch-free ``fp8_protocol.spool``
(the service's command line reads spools from there without torch); this module only writes them.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import orjson

from fp8_protocol.spool import SPOOL_VERSION, read_spool, upload_spool

__all__ = ["SPOOL_VERSION", "SpoolWriter", "dumps", "read_spool", "upload_spool"]


def dumps(body: Any) -> bytes:
    """A body or spool record as JSON bytes, whatever it holds: numpy arrays as arrays, keys that are not
    strings as their text (an HF ``id2label``), any other object as its text. One encoder for the wire and the
    spool, so that nothing a run describes can stop its telemetry on the way out."""
    return orjson.dumps(body, default=str, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


class SpoolWriter:
    """Appends records to one spool file, created (with its run record) on the first write."""

    def __init__(self, path: str | os.PathLike, run_body: dict[str, Any], client_key: str):
        self.path = Path(path)
        self._run_body = run_body
        self._client_key = client_key
        self._file = None
        self._lock = threading.Lock()

    @property
    def created(self) -> bool:
        return self._file is not None

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115 (kept open for the run)
        if self._file.tell() and not self.path.read_bytes().endswith(b"\n"):
            self._file.write(b"\n")  # an earlier job died mid-line: our records start on a line of their own
        self._write(
            {"type": "run", "version": SPOOL_VERSION, "client_key": self._client_key, "body": self._run_body}
        )

    def _write(self, record: dict[str, Any]) -> int:
        line = dumps(record) + b"\n"
        offset = self._file.tell()
        self._file.write(line)
        self._file.flush()
        return offset

    def write_batch(self, body: dict[str, Any]) -> int:
        """Append a telemetry body; returns the offset of its line (for reading it back)."""
        with self._lock:
            if self._file is None:
                self._open()
            return self._write({"type": "batch", "body": body})

    def write_status(self, status: str) -> None:
        with self._lock:
            if self._file is None:
                self._open()
            self._write({"type": "status", "status": status})

    def read_batch(self, offset: int) -> dict[str, Any]:
        """The telemetry body written at ``offset``."""
        with open(self.path, "rb") as f:
            f.seek(offset)
            return orjson.loads(f.readline())["body"]

    def close(self, delete: bool = False) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
                if delete:
                    self.path.unlink(missing_ok=True)
