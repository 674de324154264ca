"""fp8_kernels: quantize-and-record-statistics ops (PyTorch references; Triton kernels plug in here)."""
