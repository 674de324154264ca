"""The fused CPU kernel: quantize + statistics in one C pass (``fused.c``, compiled at the first CPU call by
``fused``), registered by the dispatch where it builds."""
