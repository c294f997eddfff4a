"""How long does an async checkpoint block the training loop, and how fast does it write?

    python scripts/bench_checkpoint.py --gigabytes=3 --directory=/tmp/ckpt_bench

Saves a train-state-like tree (parameters plus two Adam moments, fp32) through
`easylm.runtime.checkpoint.CheckpointManager`, the trainer's own path, while a jitted
"train step" keeps running; then writes the same number of bytes with `dd`.
Prints one JSON line, with and without `--checkpointer.checksums`, for a first
save (which also compiles) and a second: seconds the `save` call blocked, until
the files were written, until the checkpoint was complete (checksums written),
and until `sync` put it on disk; that last rate against `dd conv=fdatasync` of
the same number of bytes to the same disk, run just before.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import time

import jax
import jax.numpy as jnp

from easylm.runtime import checkpoint


def make_state(gigabytes: float, arrays: int = 24):
    """`arrays` fp32 parameters and their two moments: `gigabytes` in all."""
    per_array = int(gigabytes * 2**30 / 4 / 3 / arrays)
    rows = per_array // 4096
    # Random values: constants would compress to nothing and flatter the write rate.
    keys = iter(jax.random.split(jax.random.key(0), 3 * arrays))
    random = lambda: jax.random.normal(next(keys), (rows, 4096), jnp.float32)
    params = {f"layer_{i}": random() for i in range(arrays)}
    moments = {"mu": {k: random() for k in params}, "nu": {k: random() for k in params}}
    jax.block_until_ready((params, moments))
    nbytes = sum(x.nbytes for x in jax.tree.leaves((params, moments)))
    return params, moments, nbytes


def dd_throughput(directory: str, nbytes: int, sync: bool = True) -> float:
    path = os.path.join(directory, "dd.bin")
    count = max(nbytes // 2**24, 1)
    args = ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}"]
    start = time.time()
    result = subprocess.run(args + (["conv=fdatasync"] if sync else []), capture_output=True, text=True)
    elapsed = time.time() - start
    os.remove(path)
    match = re.search(r"(\d+) bytes", result.stderr)
    return int(match.group(1)) / elapsed / 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gigabytes", type=float, default=3.0)
    parser.add_argument("--directory", default="/tmp/easylm_ckpt_bench")
    args = parser.parse_args()
    shutil.rmtree(args.directory, ignore_errors=True)
    os.makedirs(args.directory)

    params, moments, nbytes = make_state(args.gigabytes)
    results = {"bytes": nbytes, "device": jax.devices()[0].device_kind}
    # The loop keeps stepping while the save runs. Its steps are tiny and it sleeps
    # between them, like a host waiting on an accelerator: on this 2-core CPU a
    # real CPU train step would compete with the writer for the cores.
    step = jax.jit(lambda x: jnp.tanh(x) * 0.5)
    probe = jnp.ones((256, 256))
    for checksums in (False, True):
        subprocess.run(["sync"])
        directory = os.path.join(args.directory, f"checksums_{checksums}")
        manager = checkpoint.CheckpointManager(
            directory, checkpoint.get_default_config({"keep": 2, "checksums": checksums}))
        for attempt in ("first", "second"):  # the first also compiles
            # dd just before each save: this disk and these cores are shared, and
            # their speed drifts from minute to minute.
            subprocess.run(["sync"])
            dd = dd_throughput(args.directory, nbytes, sync=True)
            subprocess.run(["sync"])
            start = time.time()
            manager.save(1 if attempt == "first" else 2, params, moments, {"position": 0}, {})
            blocked = time.time() - start
            steps = 0
            while manager._manager.is_saving_in_progress():
                probe = step(probe).block_until_ready()
                time.sleep(0.01)
                steps += 1
            written = time.time() - start
            manager.wait()  # and the checksums, if any
            complete = time.time() - start
            subprocess.run(["sync"])  # on disk, to compare with dd conv=fdatasync
            durable = time.time() - start
            results[f"checksums={checksums} {attempt}"] = {
                "blocked_s": round(blocked, 3), "written_s": round(written, 3),
                "complete_s": round(complete, 3), "synced_s": round(durable, 3),
                "write_MB_per_s": round(nbytes / written / 1e6, 1),
                "synced_MB_per_s": round(nbytes / durable / 1e6, 1),
                "dd_fdatasync_MB_per_s": round(dd, 1),
                "ratio_to_dd": round(nbytes / durable / 1e6 / dd, 2),
                "steps_while_saving": steps}
        manager.close()
        results[f"checksums={checksums} checkpoint_bytes_on_disk"] = int(subprocess.run(
            ["du", "-sb", os.path.join(directory, "2")], capture_output=True,
            text=True).stdout.split()[0])
        shutil.rmtree(directory)
    shutil.rmtree(args.directory, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
