"""The Triton kernels (the CUDA path) and their launch helpers.

``launch`` holds what every launcher shares (block and tile sizes, grids, the FP8 format constants, the
device's saturating cast); ``quantize`` (quantize + statistics, delayed scaling), ``current`` (amax pass and
current scaling), ``histogram``, ``block_quantize`` (MXFP8 and FP8 block scaling) and ``scale_update`` are
the kernels, each tested against its PyTorch reference (``fp8_kernels.reference``); ``cross_build`` builds
them for an NVIDIA GPU on a machine without one. Nothing here is imported until the first CUDA call
(``fp8_kernels.dispatch`` registers the launchers then), so importing ``fp8_kernels`` never imports triton.
"""
