"""Timing and goal helpers shared by the GPU benchmarks (kernels.py, linear.py, gpt_throughput.py).

Device work is asynchronous: a sample is N back-to-back calls between one pair of CUDA events, so launch
gaps overlap with the work as they do in training, and the clock is read once per sample, not per call. On
the CPU (smoke runs) the wall clock stands in.
"""

from __future__ import annotations

import math
import time

import torch

__all__ = ["calls_per_sample", "goal", "ms_per_call", "ms_per_call_and_host", "sync"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ms_per_call(fn, n_calls: int, device: torch.device) -> float:
    """Milliseconds per call of ``n_calls`` back-to-back ``fn(i)``: one pair of CUDA events around them all on
    a GPU (no synchronisation between calls), the wall clock on the CPU."""
    return ms_per_call_and_host(fn, n_calls, device)[0]


def ms_per_call_and_host(fn, n_calls: int, device: torch.device) -> tuple[float, float]:
    """``(ms, host ms)`` per call: ``ms_per_call``'s time, and the host's time to issue the calls (the loop
    alone, not the wait for the device after it). Where the host's time is about the device's, the device
    waited on the host between calls: the time measures the host's launches, not the device's work. On the
    CPU both are the wall clock."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for i in range(n_calls):
            fn(i)
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n_calls, host * 1e3 / n_calls
    t0 = time.perf_counter()
    for i in range(n_calls):
        fn(i)
    ms = (time.perf_counter() - t0) * 1e3 / n_calls
    return ms, ms


def calls_per_sample(
    fn, device: torch.device, sample_ms: float, *, min_calls: int, max_calls: int, floor_ms: float
) -> int:
    """N back-to-back calls of ``fn(i)`` that make a sample of about ``sample_ms``: three calls timed between
    two synchronisations (host clock), each counted as at least ``floor_ms``; N within
    ``[min_calls, max_calls]``."""
    sync(device)
    t0 = time.perf_counter()
    for i in range(3):
        fn(i)
    sync(device)
    est = (time.perf_counter() - t0) * 1e3 / 3
    return int(min(max_calls, max(min_calls, math.ceil(sample_ms / max(est, floor_ms)))))


def goal(value: float, target: float, what: str) -> dict:
    """A goal as the JSON and the summary report it: met when ``value >= target``."""
    return {"met": bool(value >= target), "value": value, "target": target, "what": what}
