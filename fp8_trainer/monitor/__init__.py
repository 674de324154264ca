"""The fp8scope telemetry client: ``Monitor`` streams a run's FP8 health to the monitor service."""

from .client import Monitor, MonitorRefused

__all__ = ["Monitor", "MonitorRefused"]
