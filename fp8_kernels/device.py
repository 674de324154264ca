"""What the device can do, asked by both the dispatch and the Triton launchers (so neither imports the
other): whether a CUDA device has FP8 tensor cores, read once per device."""

from __future__ import annotations

import functools

import torch

__all__ = ["fp8_gpu"]


def fp8_gpu(device: torch.device | None = None) -> bool:
    """Whether ``device`` (default: the current CUDA device, if any) is a CUDA GPU with FP8 tensor cores:
    compute capability 8.9 or later (Ada, Hopper, Blackwell). Read once per device."""
    if device is None:
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda")
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
