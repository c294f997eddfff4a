"""The model-family boundary: everything train, serve, eval, plan, bench and doctor
need from a model, behind one object.

A family (LLaMA: `easylm/llama/family.py`) subclasses `ModelFamily`: its config
dataclass and presets, its causal LM (`module_class`, on easylm/models/decoder.py's
skeleton), its partition rules and its Hugging Face reading; `bind(config, dtype,
param_dtype) -> Model` gives the pure functions over parameters one configured model
offers. The generic code never imports a family; commands take the family object
(`easylm.models.registry` names them for the generic commands).

    family.model_config(flags)    --<name>.base_model's preset, or the config the
                                  checkpoint records (hf::DIR's config.json, an easylm
                                  checkpoint's metadata), then the --<name>.* fields given
    family.build(flags)           that config bound to --dtype / --param_dtype: a Model

A variant (adapters on a frozen base) is another `Model` of the same family whose
`frozen` (a `Frozen`) says how to make the parameters it reads but does not train: the
trainer keeps them in `TrainState.frozen["base"]`, outside the optimizer, and they reach
the model one way: `Model.forward(params, ..., base=base)` (and `Model.head(params, base)`).
Each checkpoint records their fingerprint, and a resume refuses a base that differs from
the one the run began on.
"""

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder

from easylm.errors import UserError
from easylm.models import decoder, moe
from easylm.models.hf_checkpoint import write_safetensors
from easylm.runtime.sharding import PartitionRules, path_to_string

Params = Any  # a tree of arrays
Batch = dict  # name -> (B, T) arrays: input_tokens, target_tokens, loss_masks, ...
# (params, ids (B, T), positions (B, T) or None, segment_ids (B, T) or None, cache or None,
#  *, base: the frozen parameters a variant reads (None for a plain model), rng: dropout's
#  key or None, return_hidden) -> logits (B, T, V), or (logits, cache) with a cache, or with
# `return_hidden` the hidden states (B, T, D) that `Model.head` turns into logits. The one
# forward pass every objective, the serving engine and the evaluator run.
ForwardFn = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Frozen:
    """The parameters a variant reads but does not train (LoRA's base): no gradient, no
    optimizer state, rebuilt (not saved) at each start."""

    init: Callable[[jax.Array], Params]  # rng -> the tree, drawn (a run from scratch)
    rules: PartitionRules
    # mesh -> the tree read from --load_checkpoint and placed in its shards; None: drawn
    load: Callable[[Any], Params] | None
    # tree -> what identifies it whatever the compute dtype: what the fingerprint hashes
    identity: Callable[[Params], Any]
    # trained params -> params that compute the base alone (LoRA: each B zeroed): a
    # preference objective's reference with no second copy of the weights
    adapters_off: Callable[[Params], Params]
    # For reports (bench, planner, the run's header): the variant in words ('QLoRA rank
    # 16'), the weights the base holds and how they are stored ('nf4').
    variant: str
    num_parameters: int
    dtype: str


@dataclasses.dataclass(frozen=True)
class Model:
    """One configured model of a family: pure functions over its parameters. Objectives
    build their losses from `forward` and `head` (easylm/objectives/), the serving engine
    decodes with `forward` and `init_cache`."""

    name: str  # the family's name: flag section, run-name prefix, metadata key
    config: dict  # the model config, recorded in checkpoint metadata as `<name>_config`
    vocab_size: int
    init_params: Callable[[jax.Array], Params]  # rng -> params, a pure function (run sharded)
    forward: ForwardFn
    partition_rules: PartitionRules
    flops_per_token: Callable[[int], float]  # seq_length -> training FLOPs per token
    # (params, base=None) -> the output projection (D, V) that turns the hidden states
    # `forward(..., return_hidden=True)` gives into logits (None: no chunked loss).
    head: Callable[..., jax.Array] | None = None
    # Losses: logits for this many positions at a time (0: all at once); see
    # objectives/next_token.py.
    loss_chunk_size: int = 0
    init_cache: Callable[[int, int], Any] | None = None  # (batch, length) -> zeros
    cache_rules: PartitionRules = ()
    max_seq_length: int = 0  # the longest row the model can take (0: no limit)
    # A mixture of experts' router losses (moe.RouterLoss); the losses then call `forward`
    # with router_stats=True (objectives/router_loss.py). None: no routers.
    router_loss: Any = None
    eos_token_id: int | None = None
    num_layers: int = 1  # what the planner extrapolates over
    num_parameters: int = 0
    # (load spec, abstract params with shardings) -> params: hf::DIR, or an easylm
    # checkpoint in either layout (`ModelFamily.load_params`; `ModelFamily.build` sets it)
    load: Callable[[str, Params], Params] | None = None
    frozen: Frozen | None = None  # what a variant reads but does not train
    # seq_length -> FLOPs per token of a forward pass (a reference's); default: a third of
    # `flops_per_token` (forward 2N of the 6N)
    forward_flops_per_token: Callable[[int], float] | None = None

    def forward_flops(self, seq_length: int) -> float:
        if self.forward_flops_per_token is not None:
            return self.forward_flops_per_token(seq_length)
        return self.flops_per_token(seq_length) / 3


def apply_routed(apply, router_params, *args, router_stats=False, routing=None, **kwargs):
    """`apply(collections, *args, mutable=..., **kwargs)` of a model that may have MoE
    layers: what every forward (the plain model's, LoRA's, int8's) does with these two.
    router_stats: (out, the MoE layers' moe.RouterStats, stacked) for the router losses.
    routing: (L, N, K) expert choices to replay, as router_stats stacks them, laid out over
    the routers of `router_params` (the parameters that hold them: a LoRA base)."""
    collections = {}
    if routing is not None:
        collections[moe.REPLAY] = moe.replay_collection(router_params, routing)
    out = apply(collections, *args, mutable=["router"] if router_stats else False, **kwargs)
    return (out[0], moe.router_stats(out[1]["router"])) if router_stats else out


class ModelFamily:
    """Subclass per family; one instance, named in `easylm.models.registry`."""

    name: str = ""
    config_class: type = None  # a frozen dataclass; field metadata "help" explains a field
    presets: dict[str, dict] = {}
    default_preset: str = ""  # the commands' model when no checkpoint says otherwise
    tiny_preset: str = ""  # the benchmarks' default ('' : default_preset)
    # Run-level flag defaults of the trainer's no-flags demo (data and steps, not shape).
    demo: dict = {}
    commands: str = ""  # the package of `python -m <commands>.train|serve`
    hf_model_types: tuple[str, ...] = ()  # config.json model_types it reads (easylm.train picks)
    # config.json model_types near those it reads that it does not build: what differs
    # (the refusal names it, e.g. DeepSeek's multi-head latent attention)
    hf_not_built: dict[str, str] = {}
    remat_policies: tuple[str, ...] = ()  # the `remat_policy` field's values, cheapest first
    # The variants (easylm/variants/) its model takes: "lora" (adapters on a frozen base,
    # for a model whose projections read their own kernels once `unfused`).
    variants: tuple[str, ...] = ()
    # How transformers' fused experts/gate_up_proj orders its 2F outputs: gate's then up's
    # (Qwen3-MoE, Mixtral), or interleaved, gate_0 up_0 gate_1 ... (gpt-oss); what a PEFT
    # adapter's lora_B on it is written in.
    hf_gate_up_interleaved: bool = False

    # The family's causal LM (a subclass of easylm.models.decoder.CausalLM).
    module_class: type = None

    # ---------------------------------------------------- what a family defines

    def partition_rules(self, config):
        """The table of (regex on a parameter's path, PartitionSpec) that shards it."""
        raise NotImplementedError

    def unfused(self, config):
        """`config` computing each projection with its own matmul (what LoRA and int8 wrap:
        qwix adapts the matmul that reads a module's own kernel); the same numbers."""
        return config

    def bind(self, config, dtype=jnp.float32, param_dtype=jnp.float32) -> Model:
        module = self.module_class(config, dtype=dtype, param_dtype=param_dtype)

        def forward(params, ids, positions=None, segment_ids=None, cache=None, *, base=None,
                    rng=None, return_hidden=False, router_stats=False, routing=None):
            del base, rng  # a plain model: no frozen parameters, no dropout
            return apply_routed(
                lambda collections, *args, **kwargs: module.apply(
                    {"params": params, **collections}, *args, **kwargs),
                params, ids, positions=positions, segment_ids=segment_ids, cache=cache,
                return_hidden=return_hidden, router_stats=router_stats, routing=routing)

        return Model(
            name=self.name, config=config.to_dict(), vocab_size=config.vocab_size,
            init_params=module.init_params, forward=forward,
            head=lambda params, base=None: decoder.head_weight(params, config),
            partition_rules=self.partition_rules(config), flops_per_token=config.flops_per_token,
            loss_chunk_size=config.loss_chunk_size, init_cache=module.init_cache,
            cache_rules=decoder.CACHE_PARTITION_RULES,
            max_seq_length=config.max_position_embeddings, eos_token_id=config.eos_token_id,
            num_layers=config.num_hidden_layers, num_parameters=config.num_parameters())

    def read_hf_config(self, directory: str):
        """DIR/config.json as this family's config."""
        raise UserError(f"hf::{directory}: the {self.name} family cannot read Hugging Face "
                        f"checkpoints")

    def hf_params(self, directory: str, config, dtype: str = "keep", place=None):
        """DIR's tensors as a tree laid out as `config` says: numpy arrays cast as --dtype
        names (keep, bf16, fp32), or what `place` makes of each as it is read."""
        raise UserError(f"hf::{directory}: the {self.name} family cannot read Hugging Face "
                        f"checkpoints")

    def hf_param_shapes(self, config) -> dict[str, tuple[int, ...]]:
        """Parameter path -> shape of `config`'s model with its layers one by one (nothing
        allocated): the paths whose Hugging Face names are `hf_checkpoint.hf_key(path)`,
        and PEFT's `peft_key(path)`, by which converters and adapters map."""
        from flax import traverse_util

        module = self.module_class(config.replace(scan_layers=False))
        shapes = jax.eval_shape(module.init_params, jax.random.PRNGKey(0))
        return {path: leaf.shape
                for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}

    def shard_variant(self, config, layers: int, mp: int):
        """`config` with `layers` layers and the widths one of `mp` model-parallel shards
        holds (heads, MLP, vocabulary divided by mp): one device's activations. A config
        with `layer_types` (sliding and full layers) keeps its mix in the `layers`."""
        fields = dict(num_hidden_layers=layers, head_dim=config.head_dim,
                      num_attention_heads=math.ceil(config.num_attention_heads / mp),
                      num_key_value_heads=math.ceil(config.num_key_value_heads / mp),
                      intermediate_size=math.ceil(config.intermediate_size / mp),
                      vocab_size=math.ceil(config.vocab_size / mp))
        if hasattr(config, "layer_types"):
            kinds = config.layer_kinds()
            fields["layer_types"] = ",".join(kinds[i * len(kinds) // layers]
                                             for i in range(layers))
        return config.replace(**fields)

    def check_plannable(self, config) -> None:
        """A UserError when this machine cannot trace `config` (a GPU-only kernel)."""
        if config.attention == "cudnn" and jax.default_backend() != "gpu":
            # 'auto' picks it on a GPU only; tracing it needs cuDNN present.
            raise UserError(f"--{self.name}.attention=cudnn can only be planned where cuDNN is: "
                            f"plan on the GPU host, or with --{self.name}.attention=dot_product "
                            f"for an upper bound")

    def to_hf(self, params, config):
        """(Hugging Face name, numpy array) for each tensor of `params`, as transformers'
        class for `config.to_hf_config()` names them."""
        raise UserError(f"the {self.name} family cannot write Hugging Face checkpoints")

    def torch_reference(self, config, params):
        """The same model in HF transformers (torch, fp32): the benchmarks' and the PEFT
        check's. Read from a directory by `from_pretrained`, which converts
        what `to_hf` writes (per-expert tensors) to the model's own (transformers 5's fused
        experts), where `load_state_dict` would skip them without a word."""
        import tempfile

        import numpy as np
        import torch
        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory() as directory:
            write_safetensors(((name, np.asarray(x, np.float32))
                               for name, x in self.to_hf(params, config)), directory)
            config.to_hf_config().save_pretrained(directory)
            return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    def relayout(self, tree, like):
        """`tree` (parameters, or anything keyed like them) in the layout `like` has: layers
        stacked for a scan, or not (easylm/models/decoder.py)."""
        return decoder.relayout_like(tree, like)

    def layout(self, tree, config):
        """`tree` in the layout `config` says (`scan_layers`, the pattern's period)."""
        return decoder.relayout(tree, config.scan_layers, decoder.period(self.module_class, config))

    def state_settings(self, flags: dict, config: dict) -> dict:
        """What a run's trained parameters mean besides their values, by the flag that sets
        it (`{"--lora.rank": 8, ...}`), from its flat flags and its model config as a
        checkpoint's metadata records them: a resume under other settings is refused by
        the flag, before loading (a changed LoRA alpha would load and silently train
        another model; `easylm.variants.state_settings` adds the variants'). Here whether
        the layers are stacked (a trainstate's optimizer state is not relaid out)."""
        return {f"--{self.name}.scan_layers": bool(config.get("scan_layers"))}

    # ------------------------------------------------------------------ generic

    @property
    def serve_module(self) -> str:
        return f"{self.commands}.serve" if self.commands else ""

    @property
    def eval_module(self) -> str:
        return f"{self.commands}.eval" if self.commands else ""

    def field_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.config_class)]

    def flag_config(self, base_model: str | None = None) -> ConfigDict:
        """The `--<name>.*` flag tree: a preset name plus optional per-field overrides."""
        config = ConfigDict()
        config.base_model = base_model or self.default_preset
        for field in dataclasses.fields(self.config_class):
            config[field.name] = placeholder(_flag_type(field))
        return config

    def help_entries(self, source: str = "the preset's") -> dict:
        """`--<name>.*` help: each field's own text and its default source."""
        entries = {f"{self.name}.base_model": f"preset: {', '.join(self.presets)}"}
        for field in dataclasses.fields(self.config_class):
            text = field.metadata.get("help", "")
            entries[f"{self.name}.{field.name}"] = f"{text} (unset: {source} value)".strip()
        return entries

    def from_preset(self, name: str, **overrides):
        return preset_config(self.config_class, self.presets, name, self.name, **overrides)

    def model_config(self, flags: ConfigDict, from_checkpoint: bool = False):
        """The model's config from a command's parsed flags: the config hf::DIR's
        config.json gives (and, with `from_checkpoint`, the one an easylm checkpoint's
        metadata records), else the --<name>.base_model preset; then the --<name>.*
        fields given on the command line."""
        block = dict(flags[self.name])
        preset = block.pop("base_model")
        overrides = {k: v for k, v in block.items() if v is not None}
        recorded = self.recorded_config(flags.get("load_checkpoint", ""), from_checkpoint)
        if recorded is None:
            return self.from_preset(preset, **overrides)
        return dataclasses.replace(recorded, **overrides)

    def recorded_config(self, spec: str, from_checkpoint: bool = True):
        """The config a `--load_checkpoint` spec records, or None."""
        import os

        from easylm.runtime import checkpoint

        prefix, _, path = spec.partition("::")
        if prefix == "hf":
            return self.read_hf_config(path)
        if not (spec and from_checkpoint):
            return None
        _, directory = checkpoint.parse_load_spec(spec)
        if not os.path.isdir(os.path.join(directory, "metadata")):
            return None
        recorded = checkpoint.read_metadata(directory).get(self.metadata_key)
        if recorded is None:
            return None
        unknown = set(recorded) - set(self.field_names())
        if unknown:
            raise UserError(f"{directory}: its {self.metadata_key} has field(s) the "
                            f"{self.name} model does not know: {', '.join(sorted(unknown))}")
        return self.config_class(**recorded)

    @property
    def metadata_key(self) -> str:
        return f"{self.name}_config"

    def build(self, flags: ConfigDict, config=None, from_checkpoint: bool = False) -> Model:
        """The Model `flags` describe (`model_config`), bound to --dtype and --param_dtype
        (when a command has no --param_dtype, parameters are kept in --dtype)."""
        from easylm.runtime.dtypes import dtype_from_flag

        config = self.model_config(flags, from_checkpoint) if config is None else config
        dtype = dtype_from_flag("dtype", flags.dtype)
        param_dtype = (dtype_from_flag("param_dtype", flags.param_dtype)
                       if "param_dtype" in flags else dtype)
        model = self.bind(config, dtype, param_dtype)
        load = lambda spec, abstract: self.load_params(  # noqa: E731
            spec, config, abstract, model.partition_rules)
        return dataclasses.replace(model, load=load)

    def load_params(self, spec: str, config, abstract_params, rules: PartitionRules):
        """The parameters `spec` names, placed as `abstract_params` (with shardings) says:
        hf::DIR (`load_hf`), or an easylm checkpoint (params::, trainstate_params::,
        trainstate::) in whichever layout it was stored (`relayout`; `rules` place the
        stored layout's arrays before they are rearranged)."""
        from easylm.runtime import checkpoint

        kind, directory = checkpoint.parse_load_spec(spec, ("hf",) + checkpoint.LOAD_PREFIXES)
        if kind == "hf":
            return self.load_hf(directory, config, abstract_params)
        return read_params(directory, abstract_params, rules, self.relayout)

    def load_hf(self, directory: str, config, abstract_params):
        """DIR's tensors, each placed straight into its shards of `abstract_params`
        (host memory: one copy of the model; each device: its shards), in their layout,
        after checking that the tree and every shape are the ones `config` implies."""
        host = self.relayout(self.hf_params(directory, config), abstract_params)
        if jax.tree.structure(host) != jax.tree.structure(abstract_params):
            raise UserError(f"{directory}: the --{self.name}.* flags describe a model with "
                            f"other parameters than its config.json")

        def place(path, array, target):
            if array.shape != target.shape:
                raise UserError(f"{directory}: parameter {path_to_string(path)} has shape "
                                f"{array.shape}, but the --{self.name}.* flags imply "
                                f"{target.shape}")
            array = array.astype(target.dtype)
            return jax.make_array_from_callback(target.shape, target.sharding, lambda i: array[i])

        return jax.tree_util.tree_map_with_path(place, host, abstract_params)


def preset_config(config_class: type, presets: dict, name: str, family: str, **overrides):
    """`config_class` of preset `name` with `overrides`; unknown names are UserErrors."""
    if name not in presets:
        raise UserError(f"unknown {family} preset {name!r}; known presets: {', '.join(presets)}")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(config_class)}
    if unknown:
        raise UserError(f"unknown {family} config field(s): {', '.join(sorted(unknown))}")
    return config_class(**{**presets[name], **overrides})


def _flag_type(field: dataclasses.Field) -> type:
    kind = field.type
    if isinstance(kind, str):  # postponed annotations
        kind = {"int": int, "float": float, "str": str, "bool": bool}[kind.split(" ")[0]]
    if kind not in (int, float, str, bool):  # `int | None`
        kind = int
    return kind


def read_params(directory: str, abstract_params, rules: PartitionRules, relayout):
    """An easylm checkpoint's parameters as `abstract_params` lays them out, also when it
    was stored in another layout (`relayout(tree, like)`): then restored in its own layout,
    placed by `rules` on the same mesh, and rearranged on the devices (not donated: a
    stacked array cannot become its slices in place; the stored copy goes once done)."""
    from easylm.runtime import checkpoint
    from easylm.runtime.sharding import match_partition_rules, named_shardings

    checkpoint.check_checkpoint_dir(directory)
    stored = checkpoint.stored_tree(directory, "params")
    as_stored = jax.eval_shape(lambda tree: relayout(tree, stored), abstract_params)
    if jax.tree.structure(as_stored) == jax.tree.structure(abstract_params):
        return checkpoint.restore_items(directory, {"params": abstract_params})["params"]
    sharding = jax.tree.leaves(abstract_params)[0].sharding
    shardings = named_shardings(sharding.mesh, match_partition_rules(rules, as_stored))
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          as_stored, shardings)
    restored = checkpoint.restore_items(directory, {"params": target})["params"]
    return jax.jit(lambda tree: relayout(tree, abstract_params),
                   out_shardings=jax.tree.map(lambda x: x.sharding, abstract_params))(restored)


def abstract_params(model: Model, mesh, dtype=None) -> Any:
    """ShapeDtypeStructs of `model`'s parameters with their shardings on `mesh` (and, with
    `dtype`, that dtype): a restore or load target."""
    from easylm.runtime.sharding import match_partition_rules, named_shardings

    shapes = jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
    shardings = named_shardings(mesh, match_partition_rules(model.partition_rules, shapes))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s),
                        shapes, shardings)
