"""The model-family boundary: what a model family is, and the one configured model
(`Model`) that train, serve, eval, plan, bench and doctor run.

A family (LLaMA: `easylm/llama/family.py`) is a `ModelFamily`: its name, its config class
(a `ModelConfig`, easylm/models/config.py) and presets, its causal LM (`module_class`, on
easylm/models/decoder.py's skeleton), its partition rules, its Hugging Face adapter
(`HFAdapter`: read the config, read the tensors, write them) and the variants it takes.
`bind(config, dtype, param_dtype) -> Model` gives the pure functions over parameters one
configured model offers; its `forward` returns one `ForwardOut`, whatever was asked.
What the commands derive from a family (flags, help, the config a checkpoint records)
is easylm/model_flags.py's; loading parameters and the HF helpers are the functions at
the end of this module. The generic code never imports a family; commands take the family
object (`easylm.models.registry` names them).

A variant (adapters on a frozen base, int8) is another `Model` of the same family: its
`apply` runs another module over other parameters; `forward` is the same. LoRA's `frozen`
(a `Frozen`) says how to make the parameters it reads but does not train: the trainer
keeps them in `TrainState.frozen["base"]`, outside the optimizer, and they reach the model
one way: `Model.forward(params, ..., base=base)` (and `Model.head(params, base)`). Each
checkpoint records their fingerprint, and a resume refuses a base that differs from the
one the run began on.
"""

import dataclasses
import re
from typing import Any, Callable, Iterable

import flax.struct
import flax.traverse_util
import jax
import jax.numpy as jnp

from easylm.errors import UserError
from easylm.models import decoder, moe
from easylm.models.config import ModelConfig, preset_config
from easylm.models.hf_checkpoint import (causal_lm_class, hf_key, params_from_hf, renamed,
                                         write_safetensors)
from easylm.runtime.sharding import PartitionRules, path_to_string

Params = Any  # a tree of arrays
Batch = dict  # name -> (B, T) arrays: input_tokens, target_tokens, loss_masks, ...


@flax.struct.dataclass
class ForwardOut:
    """What `Model.forward` gives: each field is there when it was asked for, else None."""

    logits: jax.Array | None = None  # (B, T, V) in the compute dtype, (B, 1, V) with logits_at
    hidden: jax.Array | None = None  # (B, T, D), the final norm's output (return_hidden)
    cache: Any = None  # the cache passed in, with this call's entries written
    router_stats: moe.RouterStats | None = None  # the routers' statistics (router_stats=True)
    # The sparse attention indexers' KL loss, the mean over layers (indexer_loss=True)
    indexer_loss: jax.Array | None = None


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


# (params, base, rng, collections, ids, **module kwargs) -> the module's output: what a
# model (or a variant) runs its Flax module with. `collections` are extra variable
# collections (a routing to replay); `base` the frozen parameters (None for a plain model);
# `rng` dropout's key or None.
ApplyFn = Callable[..., Any]


def plain_apply(module) -> ApplyFn:
    """The `ApplyFn` of a model whose parameters are all its module's."""
    def apply(params, base, rng, collections, *args, **kwargs):
        del base, rng  # no frozen parameters, no dropout
        return module.apply({"params": params, **collections}, *args, **kwargs)
    return apply


@dataclasses.dataclass(frozen=True)
class Model:
    """One configured model of a family: pure functions over its parameters. Objectives
    build their losses from `forward` and `head` (easylm/objectives/), the serving engine
    decodes with `forward` and `init_cache`."""

    name: str  # the family's name: flag section, run-name prefix, metadata key
    config: dict  # the model config, recorded in checkpoint metadata as `<name>_config`
    vocab_size: int
    init_params: Callable[[jax.Array], Params]  # rng -> params, a pure function (run sharded)
    apply: ApplyFn
    partition_rules: PartitionRules
    flops_per_token: Callable[[int], float]  # seq_length -> training FLOPs per token
    # (params, base=None) -> the output projection (D, V) that turns the hidden states
    # `forward(..., return_hidden=True)` gives into logits (None: no chunked loss).
    head: Callable[..., jax.Array] | None = None
    # (params, base) -> the parameters that hold the routers (a LoRA base's): where a
    # routing to replay is laid out.
    router_params: Callable[[Params, Params], Params] = lambda params, base: params
    # Losses: logits for this many positions at a time (0: all at once); see
    # objectives/next_token.py.
    loss_chunk_size: int = 0
    init_cache: Callable[[int, int], Any] | None = None  # (batch, length) -> zeros
    # How far back any layer reads its cache: its layers' largest sliding window; 0: some
    # layer reads the whole history. A paged engine frees the pages a slot has passed.
    cache_reach: int = 0
    cache_rules: PartitionRules = ()
    max_seq_length: int = 0  # the longest row the model can take (0: no limit)
    # A mixture of experts' router losses (moe.RouterLoss); the losses then call `forward`
    # with router_stats=True (objectives/router_loss.py). None: no routers.
    router_loss: Any = None
    # What the losses add times the indexers' KL loss (`ModelConfig.indexer_loss_weight`);
    # they then call `forward` with indexer_loss=True (objectives/indexer_loss.py). 0: none.
    indexer_loss: float = 0.0
    eos_token_id: int | None = None
    num_layers: int = 1  # what the planner extrapolates over
    num_parameters: int = 0
    # (load spec, abstract params with shardings) -> params: hf::DIR, or an easylm
    # checkpoint in either layout (`load_params`; easylm/model_flags.py's `build` sets it)
    load: Callable[[str, Params], Params] | None = None
    frozen: Frozen | None = None  # what a variant reads but does not train
    # seq_length -> FLOPs per token of a forward pass (a reference's); default: a third of
    # `flops_per_token` (forward 2N of the 6N)
    forward_flops_per_token: Callable[[int], float] | None = None

    def forward(self, params, ids, positions=None, segment_ids=None, cache=None, *,
                base=None, rng=None, return_hidden=False, router_stats=False,
                indexer_loss=False, routing=None, images=None, logits_at=None) -> ForwardOut:
        """The one forward pass every objective, the serving engine and the evaluator run,
        over ids (B, T) at `positions` (B, T; None: 0..T-1), packed documents
        `segment_ids` (B, T) or a `cache` (`init_cache`). return_hidden: the final norm's
        output instead of logits (`head` turns it into logits); router_stats: the MoE
        layers' statistics for the router losses; indexer_loss: the sparse attention
        layers' KL loss (a model with `indexer_loss` set, trained); routing: (L, N, K)
        expert choices to replay, as router_stats stacks them; images: a multimodal
        model's image inputs (easylm/models/vision.py's `ImageInputs` fields, (B, ...)
        each), for a module that takes them; logits_at (B,): logits (B, 1, V) at one
        position of each row only."""
        collections = {}
        if routing is not None:
            collections[moe.REPLAY] = moe.replay_collection(self.router_params(params, base),
                                                            routing)
        out = self.apply(params, base, rng, collections, ids, positions=positions,
                         segment_ids=segment_ids, cache=cache, return_hidden=return_hidden,
                         mutable=[name for name, on in (("router", router_stats),
                                                        ("indexer", indexer_loss)) if on]
                         or False,
                         **({} if images is None else {"images": images}),
                         **({} if logits_at is None else {"logits_at": logits_at}))
        stats = kl = None
        if router_stats or indexer_loss:
            out, variables = out
            # None where no layer routed (the planner's one dense layer of a model whose
            # first layers are dense).
            stats = moe.router_stats(variables["router"]) if "router" in variables else None
            if indexer_loss:  # per layer, stacked where scanned
                kl = jnp.mean(jnp.concatenate([jnp.atleast_1d(v) for v in jax.tree.leaves(
                    variables.get("indexer", {"none": jnp.zeros(1)}))]))
        new_cache = None
        if cache is not None:
            out, new_cache = out
        if return_hidden:
            return ForwardOut(hidden=out, cache=new_cache, router_stats=stats, indexer_loss=kl)
        return ForwardOut(logits=out, cache=new_cache, router_stats=stats, indexer_loss=kl)

    def forward_flops(self, seq_length: int) -> float:
        if self.forward_flops_per_token is not None:
            return self.forward_flops_per_token(seq_length)
        return self.flops_per_token(seq_length) / 3


@dataclasses.dataclass(frozen=True)
class HFAdapter:
    """How a family reads and writes Hugging Face checkpoints."""

    model_types: tuple[str, ...]  # config.json model_types it reads (easylm.train picks)
    read_config: Callable[[str], ModelConfig]  # DIR -> DIR/config.json as the family's config
    # (DIR, config, dtype="keep", place=None) -> DIR's tensors as a tree laid out as `config`
    # says: numpy arrays cast as --dtype names (keep, bf16, fp32), or what `place` makes of each
    read_params: Callable[..., Params]
    # (params, config) -> (HF name, numpy array) for each tensor, as transformers' class
    # for `config.to_hf_config()` names them
    write_params: Callable[[Params, ModelConfig], Iterable]
    # config.json model_types near those it reads that it does not build: what differs
    # (the refusal names it, e.g. DeepSeek's multi-head latent attention)
    not_built: dict[str, str] = dataclasses.field(default_factory=dict)
    # How transformers' fused experts/gate_up_proj orders its 2F outputs: gate's then up's
    # (Qwen3-MoE, Mixtral), or interleaved, gate_0 up_0 gate_1 ... (gpt-oss); what a PEFT
    # adapter's lora_B on it is written in.
    gate_up_interleaved: bool = False
    # (our path prefix, transformers' module path prefix) where transformers nests what
    # our paths hold at the top (an image-text model's `model/` -> `model/language_model/`,
    # `visual/` -> `model/visual/`): what PEFT's names of its modules follow
    # (hf_checkpoint.renamed). Empty: our paths are transformers' modules.
    module_prefixes: tuple[tuple[str, str], ...] = ()
    # Whether transformers keeps the expert stacks (E, in, out) with no `is_transposed`
    # (Llama 4), which PEFT's parameter wrapper reads as (E, out, in): the adapter of such
    # a stack is written as the LoRA of its transpose (A and B trade places).
    experts_in_first: bool = False
    # (regex, replacement) applied in order to a path after `module_prefixes`, where our
    # paths are a checkpoint's names that transformers renames on load (DeepSeek-V4's
    # attn/wq_a -> self_attn/q_a_proj): what PEFT's names and --lora.target_modules and
    # --quantize's targets also match.
    module_renames: tuple[tuple[str, str], ...] = ()

    def module_path(self, path: str) -> str:
        """Our '/'-path as the path of transformers' module (and leaf) that holds it."""
        path = renamed(path, self.module_prefixes)
        for pattern, replacement in self.module_renames:
            path = re.sub(pattern, replacement, path)
        return path


class ModelFamily:
    """What a family is: subclass (or instantiate) once per family, named in
    `easylm.models.registry`. docs/families.md walks through writing one."""

    name: str = ""  # the flag section (--llama.*), the run-name prefix, the metadata key
    config_class: type[ModelConfig] = ModelConfig
    presets: dict[str, dict] = {}
    default_preset: str = ""  # the commands' model when no checkpoint says otherwise
    tiny_preset: str = ""  # the benchmarks' default ('': default_preset)
    # Run-level flag defaults of the trainer's no-flags demo (data and steps, not shape).
    demo: dict = {}
    module_class: type = None  # the family's causal LM (a decoder.CausalLM subclass)
    # The variants (easylm/variants/) its model takes: "lora" (adapters on a frozen base),
    # "int8" (weight-only serving, --quantize=int8); both for a model whose projections
    # read their own kernels once `config.unfused()`.
    variants: tuple[str, ...] = ()
    hf: HFAdapter | None = None  # None: no Hugging Face checkpoints
    # Why the commands (train, serve, eval, plan, bench: `variants.build`) refuse this
    # family as yet, in one line; '': they take it.
    not_in_commands: str = ""

    def partition_rules(self, config: ModelConfig) -> PartitionRules:
        """The table of (regex on a parameter's path, PartitionSpec) that shards it."""
        raise NotImplementedError

    def image_chats(self, config: ModelConfig, directory: str):
        """An image-text model's reader of chats with images (easylm/data/image_chats.py:
        `encode_chat`, `batch_inputs`, `image_token_id`), with the image processor saved in
        `directory`; None: the family reads no images."""
        return None

    def untrained_parameters(self, config: ModelConfig) -> tuple[str, ...]:
        """Regexes of the parameter paths a run leaves as they are (no update, no optimizer
        state, no weight decay): an image-text model's frozen vision tower."""
        return ()

    def from_preset(self, name: str, **overrides) -> ModelConfig:
        return preset_config(self.config_class, self.presets, name, self.name, **overrides)

    def bind(self, config: ModelConfig, dtype=jnp.float32, param_dtype=jnp.float32) -> Model:
        module = self.module_class(config, dtype=dtype, param_dtype=param_dtype)
        return Model(
            name=self.name, config=config.to_dict(), vocab_size=config.vocab_size,
            init_params=module.init_params, apply=plain_apply(module),
            head=lambda params, base=None: decoder.head_weight(params, config),
            partition_rules=self.partition_rules(config), flops_per_token=config.flops_per_token,
            loss_chunk_size=config.loss_chunk_size, init_cache=module.init_cache,
            cache_rules=self.module_class.cache_rules(config),
            cache_reach=decoder.cache_reach(self.module_class, config),
            max_seq_length=config.max_position_embeddings, eos_token_id=config.eos_token_id,
            num_layers=config.num_hidden_layers, num_parameters=config.num_parameters(),
            router_loss=config.router_loss(), indexer_loss=config.indexer_loss_weight())


# ------------------------------------------------------ generic functions over a family

def hf_adapter(family: ModelFamily) -> HFAdapter:
    if family.hf is None:
        raise UserError(f"the {family.name} family cannot read or write Hugging Face "
                        f"checkpoints")
    return family.hf


def hf_param_shapes(family: ModelFamily, config) -> dict[str, tuple[int, ...]]:
    """Parameter path -> shape of `config`'s model with its layers one by one (nothing
    allocated): the paths whose Hugging Face names are `hf_checkpoint.hf_key(path)`, and
    PEFT's `peft_key(path)`, by which converters and adapters map."""
    from flax import traverse_util

    module = family.module_class(config.replace(scan_layers=False))
    shapes = jax.eval_shape(module.init_params, jax.random.PRNGKey(0))
    return {path: leaf.shape
            for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def _unscanned_shapes(lm: type, config) -> dict[str, tuple[int, ...]]:
    module = lm(config.replace(scan_layers=False))
    shapes = jax.eval_shape(module.init_params, jax.random.PRNGKey(0))
    return {"/".join(path): leaf.shape
            for path, leaf in flax.traverse_util.flatten_dict(shapes).items()}


def tensors_by_rule(lm: type, params, config) -> Iterable:
    """(HF name, numpy array) of each parameter of a model whose names are all the rule's
    (`hf_checkpoint.hf_key`: the path with '.' for '/', kernels transposed), its layers
    unstacked first: OLMo 3's, Llama 4's dense parts."""
    import numpy as np

    flat = flax.traverse_util.flatten_dict(decoder.relayout(params, False), sep="/")
    for path in _unscanned_shapes(lm, config):
        key, transpose = hf_key(path)
        tensor = np.asarray(jax.device_get(flat[path]))
        yield key, (tensor.T if transpose else tensor)


def params_by_rule(lm: type, tensors, config, dtype=None, source: str = "checkpoint",
                   place=None, ignored=lambda name: False):
    """The inverse of `tensors_by_rule`: the parameters (layers one by one) from HF-named
    tensors; missing, unexpected (unless `ignored`; a tied head's copy always is) and
    misshapen tensors are UserErrors naming them (`hf_checkpoint.params_from_hf`)."""
    tied = config.tie_word_embeddings
    flat = params_from_hf(tensors, _unscanned_shapes(lm, config), source, dtype, place,
                          ignored=lambda key: (tied and key == "lm_head.weight") or ignored(key))
    return flax.traverse_util.unflatten_dict(flat, sep="/")


def layout(family: ModelFamily, tree, config):
    """`tree` (parameters, or anything keyed like them) in the layout `config` says
    (`scan_layers`, the pattern's period): easylm/models/decoder.py's two layouts."""
    return _layout(family.module_class, tree, config)


def _layout(lm: type, tree, config):
    return decoder.relayout(tree, config.scan_layers, decoder.period(config),
                            decoder.scan_blocks(lm, config) if config.scan_layers else None)


def hf_params_reader(load_hf_params: Callable, lm: type) -> Callable:
    """`HFAdapter.read_params` of a family whose `load_hf_params(DIR, dtype, place)` gives
    (config.json's config, its parameters layer by layer): the parameters laid out as the
    `config` asked for says (the loader then checks them against that config, which the
    --<family>.* flags may have changed)."""
    def read_params(directory: str, config, dtype: str = "keep", place=None):
        return _layout(lm, load_hf_params(directory, dtype, place)[1], config)
    return read_params


def torch_reference(family: ModelFamily, config, params):
    """The same model in HF transformers (torch, fp32): the benchmarks' and the PEFT
    check's. Read from a directory by `from_pretrained`, which converts what the adapter
    writes (per-expert tensors) to the model's own (transformers 5's fused experts), where
    `load_state_dict` would skip them without a word."""
    import tempfile

    import numpy as np
    import torch

    with tempfile.TemporaryDirectory() as directory:
        write_safetensors(((name, np.asarray(x, np.float32))
                           for name, x in hf_adapter(family).write_params(params, config)),
                          directory)
        config.to_hf_config().save_pretrained(directory)
        return causal_lm_class(directory).from_pretrained(directory, dtype=torch.float32).eval()


def load_params(family: ModelFamily, spec: str, config, abstract_params, rules: PartitionRules):
    """The parameters `spec` names, placed as `abstract_params` (with shardings) says:
    hf::DIR (`load_hf`), or an easylm checkpoint (params::, trainstate_params::,
    trainstate::) in whichever layout it was stored (`rules` place the stored layout's
    arrays before they are rearranged)."""
    from easylm.runtime import checkpoint

    kind, directory = checkpoint.parse_load_spec(spec, ("hf",) + checkpoint.LOAD_PREFIXES)
    if kind == "hf":
        return load_hf(family, directory, config, abstract_params)
    return read_params(directory, abstract_params, rules, decoder.relayout_like)


def load_hf(family: ModelFamily, directory: str, config, abstract_params):
    """DIR's tensors, each placed straight into its shards of `abstract_params` (host
    memory: one copy of the model; each device: its shards), in their layout, after
    checking that the tree and every shape are the ones `config` implies."""
    host = decoder.relayout_like(hf_adapter(family).read_params(directory, config),
                                 abstract_params)
    if jax.tree.structure(host) != jax.tree.structure(abstract_params):
        raise UserError(f"{directory}: the --{family.name}.* flags describe a model with "
                        f"other parameters than its config.json")

    def place(path, array, target):
        if array.shape != target.shape:
            raise UserError(f"{directory}: parameter {path_to_string(path)} has shape "
                            f"{array.shape}, but the --{family.name}.* flags imply "
                            f"{target.shape}")
        array = array.astype(target.dtype)
        return jax.make_array_from_callback(target.shape, target.sharding, lambda i: array[i])

    return jax.tree_util.tree_map_with_path(place, host, abstract_params)


def read_params(directory: str, abstract_params, rules: PartitionRules, relayout):
    """An easylm checkpoint's parameters as `abstract_params` lays them out, also when it
    was stored in another layout (`relayout(tree, like)`): then restored in its own layout,
    placed by `rules` on the same mesh, and rearranged on the devices (not donated: a
    stacked array cannot become its slices in place; the stored copy goes once done)."""
    from easylm.runtime import checkpoint
    from easylm.runtime.sharding import rule_shardings

    checkpoint.check_checkpoint_dir(directory)
    stored = checkpoint.stored_tree(directory, "params")
    as_stored = jax.eval_shape(lambda tree: relayout(tree, stored), abstract_params)
    if jax.tree.structure(as_stored) == jax.tree.structure(abstract_params):
        return checkpoint.restore_items(directory, {"params": abstract_params})["params"]
    sharding = jax.tree.leaves(abstract_params)[0].sharding
    shardings = rule_shardings(sharding.mesh, rules, as_stored)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          as_stored, shardings)
    restored = checkpoint.restore_items(directory, {"params": target})["params"]
    return jax.jit(lambda tree: relayout(tree, abstract_params),
                   out_shardings=jax.tree.map(lambda x: x.sharding, abstract_params))(restored)


def abstract_params(model: Model, mesh, dtype=None) -> Any:
    """ShapeDtypeStructs of `model`'s parameters with their shardings on `mesh` (and, with
    `dtype`, that dtype): a restore or load target."""
    from easylm.runtime.sharding import rule_shardings

    shapes = jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
    shardings = rule_shardings(mesh, model.partition_rules, shapes)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s),
                        shapes, shardings)
