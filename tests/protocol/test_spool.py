"""The spool file a job writes when the service is away, as `fp8-monitor upload` reads it."""

from __future__ import annotations

import orjson
import pytest

from fp8_protocol.spool import SPOOL_VERSION, read_spool


def _write(path, records, tail=b""):
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records) + tail)
    return path


RUN = {"type": "run", "version": SPOOL_VERSION, "client_key": "k1", "body": {"name": "r"}}


def test_a_spool_reads_back_its_run_batches_and_status_and_skips_a_torn_last_line(tmp_path):
    path = _write(
        tmp_path / "s.jsonl",
        [
            RUN,
            {"type": "batch", "body": {"idempotency_key": "a"}},
            dict(RUN),
            {"type": "status", "status": "crashed"},
        ],
        tail=b'{"type": "batch", "bo',
    )
    spool = read_spool(path)
    assert (spool.client_key, spool.run, spool.status, spool.torn_lines) == (
        "k1",
        {"name": "r"},
        "crashed",
        1,
    )
    assert spool.batches == [{"idempotency_key": "a"}]


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([{"type": "batch", "body": {}}], "first record must be the run"),
        ([{**RUN, "version": SPOOL_VERSION + 1}], "spool version"),
        ([RUN, {"type": "status", "status": "sleeping"}], "status record without a valid status"),
        ([RUN, {**RUN, "client_key": "other"}], "a second run"),
        ([RUN, {"type": "mystery"}], "unknown record type"),
    ],
)
def test_what_is_not_a_spool_is_refused_naming_the_line(tmp_path, records, message):
    with pytest.raises(ValueError, match=message):
        read_spool(_write(tmp_path / "s.jsonl", records))
