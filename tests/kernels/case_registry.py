"""The registry of the kernel cases: ``kernel_cases.py`` and ``linear_cases.py`` register theirs here with
``@case(name, devices)``; the CPU runner and the GPU tests read it."""

from __future__ import annotations

from collections.abc import Callable

import torch

#: name -> (function of the device, device types it runs on)
CASES: dict[str, tuple[Callable[[torch.device], None], tuple[str, ...]]] = {}


def case(name: str, devices: tuple[str, ...] = ("cpu", "cuda")):
    def deco(fn):
        CASES[name] = (fn, devices)
        return fn

    return deco


def case_names(device_type: str) -> list[str]:
    return [name for name, (_, devices) in CASES.items() if device_type in devices]
