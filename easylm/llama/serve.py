"""Serve a LLaMA model over HTTP: `python -m easylm.llama.serve [--flag=value ...]`.

    python -m easylm.llama.serve --load_checkpoint=params::DIR --tokenizer=embedded
    python -m easylm.llama.serve --load_checkpoint=hf::DIR --tokenizer=DIR --mesh_dim=1,1,-1

The model shape comes from the checkpoint (its metadata, or config.json for
`hf::`); `--llama.*` flags override fields. All flags: `--help`. The API and the
chat page are described in docs/serving.md.
"""

import dataclasses
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
from absl import logging as absl_logging
from ml_collections import ConfigDict

from easylm import flags as flag_lib
from easylm import quantize
from easylm.errors import UserError, exit_on_user_error
from easylm.llama.config import LLaMAConfig
from easylm.llama.model import CACHE_PARTITION_RULES, PARTITION_RULES, LLaMAForCausalLM
from easylm.serving import engine as engine_lib
from easylm.serving import server as server_lib
from easylm.serving.batcher import Batcher
from easylm.serving.engine import ModelFns
from easylm.sharding import init_sharded, make_mesh, match_partition_rules, named_shardings
from easylm.trainer import dtype_from_flag

log = logging.getLogger("easylm.llama.serve")  # not __name__: that is __main__ under -m


def llama_model_fns(config: LLaMAConfig, dtype=jnp.float32, param_dtype=jnp.float32):
    """(ModelFns for the serving engine, the Flax module)."""
    model = LLaMAForCausalLM(config, dtype=dtype, param_dtype=param_dtype)

    def apply(params, ids, positions, cache):
        return model.apply({"params": params}, ids, positions=positions, cache=cache)

    return ModelFns(apply=apply, init_cache=model.init_cache, cache_rules=CACHE_PARTITION_RULES,
                    vocab_size=config.vocab_size), model


def int8_model_fns(config: LLaMAConfig, dtype, params, mesh):
    """(ModelFns, parameters) of the int8 model (--quantize=int8) from float parameters
    placed on `mesh`. qwix quantizes the matmuls that read a module's own kernel, so the
    projections run unfused (the same numbers)."""
    fns, model = llama_model_fns(config.replace(fused_qkv=False, fused_mlp=False), dtype, dtype)
    int8 = quantize.Int8Model(model)

    def apply(params, ids, positions, cache):
        return int8.apply(params, ids, positions=positions, cache=cache)

    return (dataclasses.replace(fns, apply=apply),
            int8.quantize_sharded(params, PARTITION_RULES, mesh))


def engine_config() -> ConfigDict:
    """The flags that put a model on an engine: checkpoint, tokenizer, mesh, dtype, the
    engine's, --llama.* (shared with `easylm.llama.eval`)."""
    config = ConfigDict()
    config.load_checkpoint = ""
    config.tokenizer = "embedded"
    config.mesh_dim = "1,1,-1"
    config.dtype = "auto"
    config.quantize = "none"
    config.update(engine_lib.get_default_config())
    # The trainer's default model, so that both commands with no flags mean the same one.
    config.llama = LLaMAConfig.get_default_config({"base_model": "embedded"})
    return config


def engine_help_entries() -> dict:
    entries = {
        "load_checkpoint": "params::DIR, trainstate::DIR, trainstate_params::DIR (easylm "
                           "checkpoints) or hf::DIR (a Hugging Face model directory); empty: "
                           "random weights, for trying the server out",
        "tokenizer": "'embedded', a tokenizer directory, a tokenizer.json or a SentencePiece .model",
        "mesh_dim": "device mesh dp,fsdp,mp; one entry may be -1 (default: all devices on mp)",
        "dtype": "compute and parameter dtype: bf16, fp16, fp32, or auto (bf16 on GPU/TPU, "
                 "fp32 on CPU)",
        "quantize": quantize.HELP,
        "llama.base_model": "preset, used when the checkpoint does not record its config",
        **engine_lib.HELP,
    }
    for field in LLaMAConfig.__dataclass_fields__:
        entries[f"llama.{field}"] = "override the checkpoint's (or preset's) value"
    return entries


def default_config() -> ConfigDict:
    """One flat tree: the entry point's own flags, the engine's and the server's, and --llama.*."""
    config = engine_config()
    config.update(server_lib.get_default_config())
    return config


def help_entries() -> dict:
    return {**engine_help_entries(), **server_lib.HELP}


def model_config(config: ConfigDict) -> LLaMAConfig:
    """The checkpoint's own model config when it records one, else the preset; then the
    --llama.* fields given on the command line."""
    overrides = {k: v for k, v in config.llama.items() if k != "base_model" and v is not None}
    prefix, _, path = config.load_checkpoint.partition("::")
    recorded = None
    if prefix == "hf":
        from easylm.llama.convert_hf_to_easylm import read_hf_config

        recorded = read_hf_config(path).to_dict()
    elif config.load_checkpoint:
        from easylm import checkpoint

        _, directory = checkpoint.parse_load_spec(config.load_checkpoint)
        if os.path.isdir(os.path.join(directory, "metadata")):
            metadata = checkpoint.read_metadata(directory)
            # The trainer records `model_config`, the HF converter `llama_config`.
            recorded = metadata.get("model_config") or metadata.get("llama_config")
    if recorded is None:
        llama = LLaMAConfig.from_flags(config.llama)
    else:
        llama = LLaMAConfig(**{**recorded, **overrides})
    return llama.replace(remat_policy="none")  # remat only matters for gradients


def load_params(config: ConfigDict, model: LLaMAForCausalLM, mesh):
    """Parameters placed on `mesh` by PARTITION_RULES, cast to the serving dtype."""
    shapes = jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
    shardings = named_shardings(mesh, match_partition_rules(PARTITION_RULES, shapes))
    dtype = model.param_dtype
    if not config.load_checkpoint:
        log.warning("no --load_checkpoint: serving RANDOM weights")
        params = init_sharded(model.init_params, PARTITION_RULES, mesh, jax.random.PRNGKey(0))
        return jax.tree.map(lambda x: x.astype(dtype), params)
    prefix, _, path = config.load_checkpoint.partition("::")
    if prefix == "hf":
        from easylm.llama.convert_hf_to_easylm import load_hf_params

        _, host_params = load_hf_params(path, scan_layers=model.config.scan_layers)
        return jax.tree.map(lambda x, s: jax.device_put(x.astype(dtype), s), host_params, shardings)
    from easylm import checkpoint

    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype, sharding=s),
                            shapes, shardings)
    return checkpoint.load_params(config.load_checkpoint, abstract)


def load_engine(config: ConfigDict):
    """(Engine holding the checkpoint's parameters, tokenizer, end-of-sequence ids) from a
    parsed flag tree (`engine_config()` or a tree containing it)."""
    from easylm.tokenizer import load_tokenizer

    llama = model_config(config)
    dtype = dtype_from_flag("dtype", config.dtype)
    tokenizer = load_tokenizer(config.tokenizer)
    if len(tokenizer) > llama.vocab_size:
        raise UserError(f"--tokenizer={config.tokenizer!r} has {len(tokenizer)} tokens but the "
                        f"model's vocabulary has {llama.vocab_size}")
    if config.seq_length == 0:
        config.seq_length = min(llama.max_position_embeddings, 2048)
    if config.seq_length > llama.max_position_embeddings:
        raise UserError(f"--seq_length={config.seq_length} is above the model's "
                        f"max_position_embeddings={llama.max_position_embeddings}")
    engine_lib.check_config(config)
    if config.quantize not in quantize.MODES:
        raise UserError(f"--quantize={config.quantize!r}: expected one of "
                        f"{', '.join(quantize.MODES)}")
    mesh = make_mesh(config.mesh_dim)
    fns, model = llama_model_fns(llama, dtype, dtype)
    params = load_params(config, model, mesh)
    if config.quantize == "int8":
        fns, params = int8_model_fns(llama, dtype, params, mesh)
    engine = engine_lib.Engine(config, fns, params, mesh)
    if config.pre_compile:
        start = time.time()
        engine.warmup()
        log.info("pre-compiled %d prompt buckets and %d decode windows in %.1fs",
                 len(engine.length_buckets), len(engine.decode_buckets), time.time() - start)
    stop_ids = {i for i in (tokenizer.eos_token_id, llama.eos_token_id) if i is not None}
    return engine, tokenizer, stop_ids


def build(config: ConfigDict):
    """(FastAPI app, batcher) from a parsed flag tree; the batcher thread is started."""
    server_lib.check_config(config)  # before the weights load
    engine, tokenizer, stop_ids = load_engine(config)
    batcher = Batcher(engine, stop_ids).start()
    service = server_lib.Service(config, batcher, tokenizer)
    return server_lib.create_app(service), batcher


@exit_on_user_error
def main(argv=None):
    argv = argv or sys.argv
    usage = "usage: python -m easylm.llama.serve [--flag=value ...]"
    config = flag_lib.parse(default_config(), help_entries(), argv, usage)
    sock = server_lib.bind(config)
    # The console shows easylm's own lines (and warnings), not orbax's and jax's INFO chatter.
    # force: importing orbax already gave the root logger a handler (absl's).
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s",
                        force=True)
    logging.getLogger("easylm").setLevel(logging.INFO)
    absl_logging.set_verbosity(absl_logging.ERROR)
    app, batcher = build(config)
    server_lib.run(app, config, batcher, sock)


if __name__ == "__main__":
    main()
