"""fp8_kernels: quantize-and-record-statistics ops, PyTorch references and Triton kernels behind one dispatch.

Layout: ``dispatch`` (the one entry point: an implementation per op and device), ``device`` (what the GPU can
do, asked by the dispatch and the Triton launchers alike), ``layout`` (the aligned scale vectors),
``reference/`` (the PyTorch references: the specification), ``triton/`` (the Triton kernels and their launch
helpers: the CUDA path), ``cpu/`` (the fused C kernel: the CPU path where a compiler builds it).

Importing this package never imports triton: the Triton kernels register themselves for CUDA tensors at
the first CUDA call (see ``dispatch``).
"""

from .dispatch import (
    exponent_histogram,
    fp8_gpu,
    fused_scale_update,
    generation,
    has_kernel,
    prepare_quantize,
    quantize_current,
    quantize_current_transposed,
    quantize_with_stats,
    quantize_with_stats_transposed,
    reference_kernels,
    register,
    registered,
    restore,
    tensor_amax,
    triton_available,
    use_reference,
)
from .layout import SCALE_ALIGN_BYTES, SCALE_STRIDE, aligned_scales, as_aligned_scales, is_aligned_scale
from .reference.histogram import EXP_MAX, EXP_MIN, HIST_BINS, exponent_histogram_reference, histogram_to_dict
from .reference.quantize import (
    STAT_COLUMNS,
    current_scale_reference,
    dequantize,
    fp8_max,
    new_stats,
    overflow_threshold,
    quantize_current_reference,
    quantize_with_stats_reference,
    subnormal_threshold,
    tensor_amax_reference,
    underflow_threshold,
)

__all__ = [
    "SCALE_ALIGN_BYTES",
    "SCALE_STRIDE",
    "aligned_scales",
    "as_aligned_scales",
    "is_aligned_scale",
    "EXP_MAX",
    "EXP_MIN",
    "HIST_BINS",
    "STAT_COLUMNS",
    "current_scale_reference",
    "dequantize",
    "exponent_histogram",
    "exponent_histogram_reference",
    "fp8_gpu",
    "fp8_max",
    "new_stats",
    "fused_scale_update",
    "generation",
    "has_kernel",
    "prepare_quantize",
    "histogram_to_dict",
    "overflow_threshold",
    "quantize_current",
    "quantize_current_reference",
    "quantize_current_transposed",
    "quantize_with_stats",
    "quantize_with_stats_reference",
    "quantize_with_stats_transposed",
    "reference_kernels",
    "register",
    "registered",
    "restore",
    "subnormal_threshold",
    "tensor_amax",
    "tensor_amax_reference",
    "triton_available",
    "underflow_threshold",
    "use_reference",
]
