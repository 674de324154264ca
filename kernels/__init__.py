"""fp8_kernels: quantize-and-record-statistics ops (PyTorch references; Triton kernels plug in here)."""

from .dispatch import quantize_with_stats, register, tensor_amax
from .histogram import EXP_MAX, EXP_MIN, HIST_BINS, histogram_to_dict
from .histogram import exponent_histogram_reference as exponent_histogram
from .quantize import STAT_COLUMNS, dequantize, fp8_max, quantize_with_stats_reference, underflow_threshold

__all__ = [
    "EXP_MAX",
    "EXP_MIN",
    "HIST_BINS",
    "exponent_histogram",
    "histogram_to_dict",
    "STAT_COLUMNS",
    "dequantize",
    "fp8_max",
    "quantize_with_stats",
    "quantize_with_stats_reference",
    "register",
    "tensor_amax",
    "underflow_threshold",
]
