"""Stalled-run detector: no telemetry for longer than `DetectorConfig.stall_seconds`."""

from __future__ import annotations

from datetime import UTC, datetime

from monitor_server.core.detector_config import DetectorConfig

from .types import Finding


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)  # naive datetimes are taken as UTC


def check_stalled(
    last_telemetry_at: datetime, now: datetime, config: DetectorConfig, *, last_step: int | None = None
) -> Finding | None:
    """Rule: ``now - last_telemetry_at > stall_seconds`` -> a run-level "stalled" finding (warning; critical
    after 10 x stall_seconds). `last_step` (optional) becomes the finding's step; -1 when unknown.
    """
    silent = (_aware(now) - _aware(last_telemetry_at)).total_seconds()
    if silent <= config.stall_seconds:
        return None
    step = -1 if last_step is None else int(last_step)
    severity = "critical" if silent > 10 * config.stall_seconds else "warning"
    where = f" after step {step}" if last_step is not None else ""
    return Finding(
        kind="stalled",
        step=step,
        severity=severity,
        tensor_index=None,
        message=f"run stalled: no telemetry for {silent:.0f} s{where} (limit {config.stall_seconds:g} s)",
        evidence={
            "last_telemetry_at": _aware(last_telemetry_at).isoformat(),
            "now": _aware(now).isoformat(),
            "silent_seconds": silent,
            "stall_seconds": config.stall_seconds,
            "last_step": last_step,
        },
    )
