"""The fp8scope telemetry client: ``Monitor`` streams a run's FP8 health to the monitor service;
``fp8_trainer.monitor.read.Reader`` reads runs back as numpy arrays or pandas frames."""

from .client import Monitor, MonitorRefused

__all__ = ["Monitor", "MonitorRefused"]
