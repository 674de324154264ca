"""The `fp8-train` application: a GPT trained in FP8 on the library (`fp8_trainer`), its checkpoints, faults,
incident capture and replay. The library never imports it."""
