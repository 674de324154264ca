"""Training-health detectors: pure, incremental, numpy-vectorised; the API layer stores their findings."""

# the modules that define detectors: importing them registers the detectors the engine runs (base.py)
from monitor_server.core.detector_config import DetectorConfig

from . import amax, loss, nonfinite, quality, tensors  # noqa: F401
from .engine import DetectorEngine, check_stalled
from .types import ALERT_KINDS, Finding, StepBatch

__all__ = [
    "ALERT_KINDS",
    "DetectorConfig",
    "DetectorEngine",
    "Finding",
    "StepBatch",
    "check_stalled",
]
