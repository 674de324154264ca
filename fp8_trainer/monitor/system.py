"""System metrics, sampled on the monitor's background thread (never on the training thread): the host
memory of the training process and, on a GPU, the device's utilisation and memory through NVML.

NVML comes from the ``nvidia-ml-py`` package (import name ``pynvml``) where it is installed; without it, or
without a GPU, the GPU metrics are simply absent. Each sample is a dict of scalars attached to the newest
step of a telemetry batch (about once a second), so they chart beside the loss.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("fp8scope.monitor")

#: the scalar names the sampler writes (``step_time_s`` and ``tokens_per_s`` are the Monitor's, per step)
HOST_MEMORY = "host_memory_mb"
GPU_UTILIZATION = "gpu_utilization"
GPU_MEMORY = "gpu_memory_mb"

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def host_memory_mb() -> float | None:
    """Resident memory of this process in MiB (Linux ``/proc``), or None where unavailable."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except (OSError, ValueError, IndexError):
        return None


class SystemSampler:
    """Samples host memory and, for `gpu_index` (None: no GPU), NVML utilisation and memory."""

    def __init__(self, gpu_index: int | None = None):
        self._nvml: Any = None
        self._handle: Any = None
        if gpu_index is not None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
                self._nvml = pynvml
            except Exception:  # no NVML (package or driver): the GPU metrics are left out, not an error
                log.debug("NVML unavailable; GPU utilisation and memory are not sampled", exc_info=True)

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        mem = host_memory_mb()
        if mem is not None:
            out[HOST_MEMORY] = mem
        if self._nvml is not None:
            try:
                out[GPU_UTILIZATION] = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
                out[GPU_MEMORY] = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20
            except Exception:  # a transient NVML error: this sample goes without
                pass
        return out
