"""The contract between the training runtime (`fp8_trainer`) and the monitor service (`monitor_server`):
torch-free, imported by both, while neither of those two imports the other."""
