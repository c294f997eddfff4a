"""Multi-process JAX: `--jax_distributed.*`, EasyLM's names for `jax.distributed.initialize`.

With `--jax_distributed.initialize=True` and the other fields empty, JAX detects
the cluster itself (TPU pods, SLURM); otherwise the fields are passed through.

A process that cannot reach all the others within `initialization_timeout`
seconds exits with one clear line (exit status 2). JAX's own timeout ends the
process with a C++ abort and a stack trace instead, so a watchdog thread fires
first (the connect call releases the GIL, so the thread runs).
"""

import os
import sys
import threading

import jax
from ml_collections import ConfigDict

from easylm.errors import UserError

HELP = {
    "initialize": "call jax.distributed.initialize before anything else (multi-host runs)",
    "coordinator_address": "host:port of process 0; empty: auto-detect (TPU pod, SLURM)",
    "num_processes": "number of processes; 0: auto-detect",
    "process_id": "this process's index; -1: auto-detect",
    "local_device_ids": "comma-separated local device ids this process uses; empty: all",
    "initialization_timeout": "seconds to wait for all processes to connect before exiting "
                              "with an error",
}


def get_default_config(updates=None) -> ConfigDict:
    config = ConfigDict()
    config.initialize = False
    config.coordinator_address = ""
    config.num_processes = 0
    config.process_id = -1
    config.local_device_ids = ""
    config.initialization_timeout = 300
    if updates is not None:
        config.update(ConfigDict(updates).copy_and_resolve_references())
    return config


def initialize(config: ConfigDict) -> None:
    if not config.initialize:
        return
    timeout = config.initialization_timeout
    if timeout < 1:
        raise UserError(f"--jax_distributed.initialization_timeout must be >= 1 second, "
                        f"got {timeout}")
    try:
        local = [int(i) for i in config.local_device_ids.split(",") if i]
    except ValueError:
        raise UserError(f"--jax_distributed.local_device_ids={config.local_device_ids!r} must "
                        f"be comma-separated integers") from None
    who = ("this process" if config.process_id < 0 else
           f"process {config.process_id} of {config.num_processes or '?'}")
    where = config.coordinator_address or "the auto-detected coordinator"
    watchdog = threading.Timer(timeout, _give_up, [
        f"jax.distributed: {who} waited {timeout} s (--jax_distributed.initialization_timeout) "
        f"for all processes to connect to {where}; a process did not start, or cannot reach "
        f"that address, or was given another --jax_distributed.num_processes"])
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address or None,
            num_processes=config.num_processes or None,
            process_id=None if config.process_id < 0 else config.process_id,
            local_device_ids=local or None,
            initialization_timeout=timeout + 60,  # ours fires first, with a clear message
        )
    except ValueError as e:  # nothing given and no cluster detected, or inconsistent values
        raise UserError(f"jax.distributed could not start: {e} (no TPU pod, SLURM or MPI "
                        f"job detected? then give --jax_distributed.coordinator_address, "
                        f"num_processes and process_id)") from None
    finally:
        watchdog.cancel()


def _give_up(message: str):
    # Like errors.exit_on_user_error, from a thread: the main thread is stuck in C++.
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    os._exit(2)
