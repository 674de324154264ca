"""The PyTorch references: the specification every kernel is tested against, and the path wherever no kernel
is registered. ``quantize`` (quantize + statistics, current scaling, the FP8 format thresholds and the
statistics row), ``histogram`` (the exponent histogram's layout) and ``block_quantize`` (MXFP8 and FP8 block
scaling, with the block-scaled matmul's emulation)."""
