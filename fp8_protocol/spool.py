"""Reading and replaying a monitor spool file (``fp8-monitor upload SPOOL``); no torch needed.

The file is written by the training client (``fp8_trainer.monitor.spool.SpoolWriter``): JSON lines,
appended and flushed one record at a time, so a job killed mid-run leaves a usable file (a torn last line
is skipped):

* ``{"type": "run", "version": 1, "client_key": K, "body": {...}}`` first: the ``POST /runs`` body.
  ``client_key`` makes registering idempotent, so the run the service saw before an outage is found again;
* ``{"type": "batch", "body": {...}}``: a telemetry body exactly as it would have been posted, with its
  ``idempotency_key`` (the service stores a key once, so replaying a batch delivered before is harmless);
* ``{"type": "status", "status": ...}``: the run's final status (one of ``fp8_protocol.runs.RUN_STATUSES``).

Replaying the whole file in order is therefore always correct: uploading a spool twice, or one whose
batches were partly delivered already, stores every step exactly once.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from fp8_protocol.api import API_PREFIX
from fp8_protocol.runs import RUN_STATUSES

__all__ = ["SPOOL_VERSION", "SpoolContents", "UploadResult", "read_spool", "upload_spool"]

SPOOL_VERSION = 1


@dataclass
class SpoolContents:
    """A parsed spool file."""

    client_key: str
    run: dict[str, Any]
    batches: list[dict[str, Any]] = field(default_factory=list)
    status: str | None = None
    torn_lines: int = 0


def read_spool(path: str | os.PathLike[str]) -> SpoolContents:
    """Parse a spool file.

    Raises:
        ValueError: not a spool (no run record first, unknown version or record type), naming the line.
    """
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    records = []
    torn = 0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            # a job that died while writing leaves one torn line: at the end, or before a later session's
            if i >= len(lines) - 1 or lines[i].startswith(b'{"type":"run"'):
                torn += 1
                continue
            raise ValueError(f"{path}:{i}: not a JSON object line") from None
        records.append((i, record))
    if not records or records[0][1].get("type") != "run":
        raise ValueError(f"{path}: not an fp8scope spool (the first record must be the run registration)")
    first = records[0][1]
    if first.get("version") != SPOOL_VERSION:
        raise ValueError(f"{path}:1: spool version {first.get('version')!r}, expected {SPOOL_VERSION}")
    if not isinstance(first.get("client_key"), str) or not isinstance(first.get("body"), dict):
        raise ValueError(f"{path}:{records[0][0]}: the run record lacks its client_key or body")
    out = SpoolContents(client_key=first["client_key"], run=first["body"], torn_lines=torn)
    for i, rec in records[1:]:
        kind = rec.get("type") if isinstance(rec, dict) else None
        if kind == "batch" and isinstance(rec.get("body"), dict):
            out.batches.append(rec["body"])
        elif kind == "status" and rec.get("status") in RUN_STATUSES:
            out.status = rec["status"]
        elif kind in ("batch", "status"):
            field_name = "body" if kind == "batch" else "status"
            raise ValueError(f"{path}:{i}: a {kind} record without a valid {field_name}")
        elif kind == "run":  # a second writer session of the same run appends its own copy of the record
            if rec.get("client_key") != out.client_key:
                raise ValueError(
                    f"{path}:{i}: a second run (another client_key) was appended to this spool; "
                    "split the file at this line and upload each part"
                )
        else:
            raise ValueError(f"{path}:{i}: unknown record type {kind!r}")
    return out


@dataclass
class UploadResult:
    """What ``upload_spool`` did."""

    run_id: int
    created: bool
    batches: int = 0
    stored_steps: int = 0
    duplicate_batches: int = 0
    rejected: list[str] = field(default_factory=list)
    status: str | None = None


def _post(client: httpx.Client, url: str, body: dict[str, Any], attempts: int = 5) -> httpx.Response:
    """POST with retries on connection errors and 5xx (the same body, so the same idempotency key)."""
    delay = 0.2
    for attempt in range(attempts):
        try:
            r = client.post(url, content=orjson.dumps(body), headers={"Content-Type": "application/json"})
            if r.status_code < 500:
                return r
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 3.0)
    return r


def upload_spool(path: str | os.PathLike[str], url: str, token: str | None = None) -> UploadResult:
    """Replay a spool into the service at ``url`` (the service root): register the run (idempotently,
    by its client key), post every batch in order, then set the final status.

    Batches the service rejects (4xx) are reported in ``rejected``, the others are still sent.

    Raises:
        ValueError: the file is not a spool.
        RuntimeError: the run cannot be registered (the service's answer).
        httpx.TransportError: the service is unreachable.
    """
    spool = read_spool(path)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = url.rstrip("/") + API_PREFIX
    with httpx.Client(headers=headers, timeout=30.0) as client:
        r = _post(client, f"{base}/runs", {**spool.run, "client_key": spool.client_key})
        if r.status_code not in (200, 201):
            raise RuntimeError(f"registering the run failed: HTTP {r.status_code}: {r.text[:500]}")
        run_id = r.json()["id"]
        result = UploadResult(run_id=run_id, created=r.status_code == 201)
        for body in spool.batches:
            r = _post(client, f"{base}/runs/{run_id}/telemetry", body)
            result.batches += 1
            if r.status_code == 200:
                answer = r.json()
                result.stored_steps += answer["stored_steps"]
                result.duplicate_batches += bool(answer["duplicate"])
            else:
                result.rejected.append(f"{body.get('idempotency_key')}: HTTP {r.status_code}: {r.text[:300]}")
        if spool.status is not None:
            r = client.patch(f"{base}/runs/{run_id}", json={"status": spool.status})
            if r.status_code == 200:
                result.status = spool.status
            else:
                result.rejected.append(f"status {spool.status}: HTTP {r.status_code}: {r.text[:300]}")
    return result
