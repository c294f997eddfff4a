"""Devices and runs: the mesh and sharding, multi-host start, dtypes, FLOPs and MFU, profiling, checkpoints."""
