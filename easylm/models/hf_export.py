"""The `convert_easylm_to_hf` command's flow, for any family: check the flags, tell a LoRA
run's checkpoint from a whole model's, write the HF directory (or PEFT adapter) into
`OUT.partial`, verify it, and rename it when complete. A family's converter passes its
own pieces (`Exporter`)."""

import dataclasses
import os
import shutil
from typing import Callable

import jax
import jax.numpy as jnp

from easylm.errors import INSTALL, UserError
from easylm.runtime.checkpoint import (
    check_free_space,
    disk_full_error,
    is_disk_full,
    parse_load_spec,
    read_metadata,
)

LORA_MODES = ("adapter", "merged")


@dataclasses.dataclass(frozen=True)
class Exporter:
    dtypes: dict  # --dtype -> the cast it makes (None: keep)
    load_checkpoint: Callable  # spec -> (config, params)
    merged_params: Callable  # (spec, metadata, base_spec) -> (config, params)
    export_adapter: Callable  # (flags, output_dir, metadata) -> None
    export: Callable  # (params, config, directory, dtype, tokenizer, max_shard_gb)
    verify: Callable  # (params, config, directory) -> max |logit difference| (needs torch)


def run(FLAGS, exporter: Exporter) -> None:
    if not FLAGS.load_checkpoint or not FLAGS.output_dir:
        raise UserError("both --load_checkpoint and --output_dir are required")
    if FLAGS.dtype not in exporter.dtypes:
        raise UserError(f"--dtype={FLAGS.dtype!r} is not one of {', '.join(exporter.dtypes)}")
    output_dir = os.path.abspath(FLAGS.output_dir)
    if os.path.exists(output_dir):
        raise UserError(f"{output_dir} already exists; refusing to overwrite it")
    _, directory = parse_load_spec(FLAGS.load_checkpoint)
    metadata = read_metadata(directory)
    is_lora = bool(metadata.get("flags", {}).get("lora.rank"))
    if FLAGS.lora_mode not in ("",) + LORA_MODES:
        raise UserError(f"--lora_mode={FLAGS.lora_mode!r} is not one of {', '.join(LORA_MODES)}")
    if is_lora != bool(FLAGS.lora_mode):
        raise UserError(f"{directory} is a LoRA run's checkpoint: pass --lora_mode=adapter or "
                        f"merged" if is_lora else f"--lora_mode={FLAGS.lora_mode}: {directory} "
                        f"is not a LoRA run's checkpoint")
    if FLAGS.lora_mode == "adapter":
        return exporter.export_adapter(FLAGS, output_dir, metadata)
    if FLAGS.lora_mode == "merged":
        config, params = exporter.merged_params(FLAGS.load_checkpoint, metadata, FLAGS.lora_base)
    else:
        config, params = exporter.load_checkpoint(FLAGS.load_checkpoint)
    _write(FLAGS, exporter, config, params, output_dir)


def _write(FLAGS, exporter: Exporter, config, params, output_dir: str) -> None:
    partial = output_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    cast = exporter.dtypes[FLAGS.dtype]
    needed = check_free_space(output_dir, sum(
        x.size * (jnp.dtype(cast).itemsize if cast else x.dtype.itemsize)
        for x in jax.tree.leaves(params)), "the export")
    try:
        try:
            exporter.export(params, config, partial, FLAGS.dtype, FLAGS.tokenizer,
                            FLAGS.max_shard_gb)
        except Exception as e:
            if not is_disk_full(e):
                raise
            raise disk_full_error("the export", partial, needed) from None
        if FLAGS.verify:
            _verify(exporter, params, config, partial, FLAGS.verify_tolerance)
        os.replace(partial, output_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print(f"wrote {output_dir}")


def _verify(exporter: Exporter, params, config, directory: str, tolerance: float) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"verify: skipped, torch is not installed ({INSTALL['torch']})")
        return
    diff = exporter.verify(params, config, directory)
    print(f"verify: max |logit difference| vs transformers = {diff:.3g}")
    if not diff <= tolerance:
        raise UserError(f"verification failed: max |logit difference| {diff:.3g} exceeds "
                        f"--verify_tolerance={tolerance}")
