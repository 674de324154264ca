"""Reporting shared by the GPU benchmarks (gpt_throughput.py, gpt_ceiling.py, kernels.py, linear.py,
kernel_configs.py): the device's name in a report's first line, the goals table, and the JSON result.

Timing lives in ``gpu_timing``; this module holds what each benchmark did the same way after timing, so that
a report's layout (which scripts/gpu-check.sh reads) has one home.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

__all__ = ["device_name", "failure", "meta_head", "print_goals", "write_json"]


def device_name(device: torch.device) -> str:
    """The GPU's name on CUDA; elsewhere the processor's (or plain "cpu" where the platform says nothing)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


def failure(e: BaseException) -> str:
    """How a configuration or implementation that broke off is reported (the others are still measured):
    the exception's type and message."""
    return f"failed ({type(e).__name__}: {e})"


def meta_head(device: torch.device, smoke: bool) -> dict:
    """The first keys of every GPU benchmark's ``meta``: where it ran, whether it was a smoke run (whose
    numbers are not measurements) and with which torch."""
    return {
        "device": device_name(device),
        "device_type": device.type,
        "smoke": smoke,
        "torch": torch.__version__,
    }


def print_goals(goals: dict[str, dict], key_width: int, value_format: str) -> None:
    """One line per goal under ``goals:``-style headings the caller prints: its key, value, target and
    whether it was met. Widths are the caller's, so each benchmark's table keeps its own layout."""
    for key, g in goals.items():
        verdict = "met" if g["met"] else "NOT met"
        print(f"  {key:<{key_width}} {g['value']:{value_format}} (target >= {g['target']:g}): {verdict}")


def write_json(out: Path | str, data: object, *, indent: int = 2, announce: bool = True) -> Path:
    """Write ``data`` as JSON to ``out`` (its folder created), and say so on stdout unless ``announce`` is
    off: the smoke tests look for that ``wrote ...`` line."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent))
    if announce:
        print(f"wrote {path}")
    return path
