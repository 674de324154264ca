"""What the training job and the service share about incident replays (``fp8-train replay``,
docs/replay.md)."""

from __future__ import annotations

#: The answers of a replay to "is it FP8's fault?"
VERDICTS: tuple[str, ...] = ("fp8-caused", "not-fp8", "not-reproducible")
#: The name of the custom event the job sends when it writes an incident bundle (details: ``path``).
INCIDENT_BUNDLE_EVENT = "incident_bundle"
