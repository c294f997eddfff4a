"""Multi-process JAX: `--jax_distributed.*`, EasyLM's names for `jax.distributed.initialize`.

With `--jax_distributed.initialize=True` and the other fields empty, JAX detects
the cluster itself (TPU pods, SLURM); otherwise the fields are passed through.
"""

import jax
from ml_collections import ConfigDict

HELP = {
    "initialize": "call jax.distributed.initialize before anything else (multi-host runs)",
    "coordinator_address": "host:port of process 0; empty: auto-detect (TPU pod, SLURM)",
    "num_processes": "number of processes; 0: auto-detect",
    "process_id": "this process's index; -1: auto-detect",
    "local_device_ids": "comma-separated local device ids this process uses; empty: all",
}


def get_default_config(updates=None) -> ConfigDict:
    config = ConfigDict()
    config.initialize = False
    config.coordinator_address = ""
    config.num_processes = 0
    config.process_id = -1
    config.local_device_ids = ""
    if updates is not None:
        config.update(ConfigDict(updates).copy_and_resolve_references())
    return config


def initialize(config: ConfigDict) -> None:
    if not config.initialize:
        return
    local = [int(i) for i in config.local_device_ids.split(",") if i]
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address or None,
        num_processes=config.num_processes or None,
        process_id=None if config.process_id < 0 else config.process_id,
        local_device_ids=local or None,
    )
