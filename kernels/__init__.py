"""fp8_kernels: quantize-and-record-statistics ops (PyTorch references; Triton kernels plug in here)."""

from .dispatch import quantize_with_stats, register, tensor_amax
from .quantize import STAT_COLUMNS, dequantize, fp8_max, quantize_with_stats_reference, underflow_threshold

__all__ = [
    "STAT_COLUMNS",
    "dequantize",
    "fp8_max",
    "quantize_with_stats",
    "quantize_with_stats_reference",
    "register",
    "tensor_amax",
    "underflow_threshold",
]
