"""Serving's setup for any model family, as `trainer.main` is training's: flags ->
model -> parameters on the mesh -> Engine, Batcher, Service -> HTTP.

    python -m easylm.llama.serve --load_checkpoint=params::DIR --tokenizer=embedded

The model's config is the one the checkpoint records (its metadata's
`<family>_config`, or config.json for `hf::DIR`), else the `--<family>.base_model`
preset; `--<family>.*` flags override fields. `python -m easylm.llama.eval` loads
its model through `load_engine` too.
"""

import dataclasses
import logging
import sys

import jax
from absl import logging as absl_logging
from ml_collections import ConfigDict

from easylm import flags as flag_lib, model_flags, variants
from easylm.errors import UserError, exit_on_user_error
from easylm.models.family import Model, ModelFamily, abstract_params
from easylm.runtime import easylm_flags, run_flags
from easylm.runtime.sharding import init_sharded, make_mesh
from easylm.serving import engine as engine_lib

log = logging.getLogger("easylm.serving")  # not __name__: that is __main__ under -m

# An engine (the server's, the decode benchmark's) splits the model over all devices by
# default: each decode step reads every weight, and on mp each device reads only its
# shard, where fsdp would gather whole weights at every step and dp hold them on each.
ENGINE_MESH_DIM = "1,1,-1"
# How the engine's --mesh_dim and --dtype differ from the trainer's (easylm/runtime/run_flags.py).
ENGINE_NOTES = {"mesh_dim": "default: all devices on mp, the model split over them",
                "dtype": "the parameters are kept in it too: there is no --param_dtype"}


def engine_config(family: ModelFamily) -> ConfigDict:
    """The flags that put a model on an engine: checkpoint, tokenizer, mesh, dtype, the
    engine's, --<family>.* (shared with `easylm.llama.eval`)."""
    config = run_flags.get_default_config("load_checkpoint", "tokenizer", "mesh_dim", "dtype",
                                          mesh_dim=ENGINE_MESH_DIM)
    config.lora_checkpoint = ""
    for name, default in variants.flag_sections(family, serving=True).items():  # --quantize
        config[name] = default
    config.update(engine_lib.get_default_config())
    # The trainer's default model, so that both commands with no flags mean the same one.
    config[family.name] = model_flags.flag_config(family)
    return config


def engine_help_entries(family: ModelFamily) -> dict:
    return {
        **run_flags.help_entries("load_checkpoint", "tokenizer", "mesh_dim", "dtype",
                                 load_checkpoint="empty: random weights, for trying the "
                                                 "server out",
                                 **ENGINE_NOTES),
        "lora_checkpoint": "LoRA adapters to fold into --load_checkpoint's weights as they "
                           "load: a LoRA run's checkpoint (DIR, or params::DIR) or a PEFT "
                           "adapter directory",
        **variants.help_entries(family, serving=True),
        **engine_lib.HELP,
        **model_flags.help_entries(family, "the checkpoint's, or the preset's"),
        f"{family.name}.base_model": "preset, used when the checkpoint does not record its "
                                     "config",
    }


def default_config(family: ModelFamily) -> ConfigDict:
    """One flat tree: the command's own flags, the engine's and the server's, --<family>.*."""
    from easylm.serving import server as server_lib

    config = engine_config(family)
    config.update(server_lib.get_default_config())
    return config


def help_entries(family: ModelFamily) -> dict:
    from easylm.serving import server as server_lib

    return {**engine_help_entries(family), **server_lib.HELP}


def model_config(family: ModelFamily, config: ConfigDict):
    """The checkpoint's own model config when it records one, else the preset; then the
    --<family>.* fields given on the command line."""
    model = model_flags.model_config(family, config, from_checkpoint=True)
    return dataclasses.replace(model, remat_policy="none")  # remat only matters for gradients


def load_params(config: ConfigDict, model: Model, mesh):
    """`model`'s parameters placed on `mesh` by its partition rules, in its parameter
    dtype (the serving dtype): --load_checkpoint's, or random."""
    if not config.load_checkpoint:
        log.warning("no --load_checkpoint: serving RANDOM weights")
        return init_sharded(model.init_params, model.partition_rules, mesh, jax.random.PRNGKey(0))
    _refuse_adapters_alone(config.load_checkpoint)
    # The trainer's loader: hf::DIR checked against the flags, an easylm checkpoint in
    # either layout (scanned or not) placed in the served one.
    return model.load(config.load_checkpoint, abstract_params(model, mesh))


def _refuse_adapters_alone(spec: str):
    """A variant's checkpoint (a LoRA run's: adapters, and only a record of their frozen
    base) is no model to serve alone: one line that says what to pass instead."""
    from easylm.runtime import checkpoint

    kind, directory = checkpoint.parse_load_spec(spec, ("hf",) + checkpoint.LOAD_PREFIXES)
    if kind == "hf" or not checkpoint.has_item(directory, "metadata"):
        return
    base = (checkpoint.read_metadata(directory).get("frozen") or {}).get("source")
    if base:
        named = "its base" if base == "init" else base  # 'init': drawn, never saved
        raise UserError(f"--load_checkpoint={spec} holds adapters trained on a frozen base, "
                        f"not a whole model: pass the base and the adapters, "
                        f"--load_checkpoint={named} --lora_checkpoint={directory}")


def load_engine(family: ModelFamily, config: ConfigDict):
    """(Engine holding the checkpoint's parameters, tokenizer, end-of-sequence ids) from a
    parsed flag tree (`engine_config()` or a tree containing it)."""
    from easylm.data.tokenizer import load_tokenizer

    settings = model_config(family, config)
    # --quantize=int8: the int8 variant, which reads the float weights (and folds in
    # --lora_checkpoint's adapters) and quantizes them on the devices.
    model = variants.build(family, config, settings, serving=True)
    tokenizer = load_tokenizer(config.tokenizer)
    if len(tokenizer) > model.vocab_size:
        raise UserError(f"--tokenizer={config.tokenizer!r} has {len(tokenizer)} tokens but the "
                        f"model's vocabulary has {model.vocab_size}")
    limit = model.max_seq_length or 2048
    if config.seq_length == 0:
        config.seq_length = min(limit, 2048)
    if config.seq_length > limit:
        raise UserError(f"--seq_length={config.seq_length} is above the model's "
                        f"max_position_embeddings={limit}")
    engine_lib.check_config(config)
    if config.get("lora_checkpoint") and not config.load_checkpoint:
        raise UserError(f"--lora_checkpoint={config.lora_checkpoint}: give the base its "
                        f"adapters fold into with --load_checkpoint")
    mesh = make_mesh(config.mesh_dim)
    if mesh.shape["sp"] > 1:  # decoding reads a whole cache; only training splits rows
        raise UserError(f"--mesh_dim={config.mesh_dim}: serving does not split the sequence; "
                        f"give sp=1 (split the devices over fsdp or mp instead)")
    params = load_params(config, model, mesh)
    engine = engine_lib.Engine(config, model, params, mesh)
    if config.pre_compile:
        engine.warmup()  # logs what it compiled, in how long
    stop_ids = {i for i in (tokenizer.eos_token_id, model.eos_token_id) if i is not None}
    return engine, tokenizer, stop_ids


def build(family: ModelFamily, config: ConfigDict):
    """(FastAPI app, batcher) from a parsed flag tree; the batcher thread is started."""
    from easylm.serving import server as server_lib
    from easylm.serving.batcher import Batcher

    server_lib.check_config(config)  # before the weights load
    engine, tokenizer, stop_ids = load_engine(family, config)
    images, no_images = image_reader(family, config)
    batcher = Batcher(engine, stop_ids).start()
    service = server_lib.Service(config, batcher, tokenizer, images, no_images)
    return server_lib.create_app(service), batcher


def image_reader(family: ModelFamily, config: ConfigDict):
    """(the family's reader of images with the checkpoint's own image processor, '') for
    an image-text model; else (None, why requests' image parts are refused). A missing
    preprocessor_config.json serves text only, with a warning."""
    from easylm.models.vision import processor_directory

    directory = processor_directory(config.tokenizer, config.load_checkpoint)
    try:
        images = family.image_chats(model_config(family, config), directory)
    except UserError as e:
        log.warning("serving text only: %s", e)
        return None, f"this server reads no images ({e})"
    return images, "" if images is not None else "this model reads no images"


def parse_flags(family: ModelFamily, argv: list[str]) -> ConfigDict:
    """`argv` (argv[0] is the program) as `python -m <family>.serve` reads it, EasyLM's
    flag names included (easylm/runtime/easylm_flags.py)."""
    command = model_flags.command(family, "serve")
    usage = (f"Serve a {family.name} model over HTTP (OpenAI-style API and a chat page).\n\n"
             f"  {command} --load_checkpoint=params::DIR --tokenizer=embedded\n\n"
             f"usage: {command} [--flag=value ...]")
    config = default_config(family)
    common = [name for name in ("load_checkpoint", "tokenizer", "host", "port", "api_key",
                                "mesh_dim", "dtype", "batch_size", "seq_length",
                                f"{family.name}.base_model")
              if name in flag_lib.flatten(config)]
    return flag_lib.parse(config, help_entries(family), argv, usage + "  (all flags: --helpfull)",
                          common=common, aliases=easylm_flags.serve_aliases(family))


@exit_on_user_error
def main(family: ModelFamily, argv=None):
    """`python -m <family>.serve`: parse, bind the port, load, serve until stopped."""
    from easylm.serving import server as server_lib

    config = parse_flags(family, argv or sys.argv)
    sock = server_lib.bind(config)
    # The console shows easylm's own lines (and warnings), not orbax's and jax's INFO chatter.
    # force: importing orbax already gave the root logger a handler (absl's).
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s",
                        force=True)
    logging.getLogger("easylm").setLevel(logging.INFO)
    absl_logging.set_verbosity(absl_logging.ERROR)
    app, batcher = build(family, config)
    server_lib.run(app, config, batcher, sock)
