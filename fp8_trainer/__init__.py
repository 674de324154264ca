"""fp8scope FP8 training runtime."""
