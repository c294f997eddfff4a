"""A family's LoRA variant (easylm/variants/lora.py) as a `Model`: adapters trained on a
frozen base, for any family whose model reads each kernel in its own module's matmul.

A family gives its LoraModel (its model, unfused), its partition rules and its output
projection (`ModelFamily.build` makes them); what is here is the same for every family:
the forward pass on (adapters, base) that every objective builds its loss from, the frozen
base (drawn, or read from --load_checkpoint into its shards and then cast or quantized on
the devices), its fingerprint check, and the --lora.* settings a run's adapters mean
something under.
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from easylm.errors import UserError
from easylm.models.family import Frozen, Model
from easylm.runtime import checkpoint
from easylm.runtime.dtypes import dtype_from_flag
from easylm.runtime.sharding import PartitionRules, rule_shardings
from easylm.variants.lora import (
    DEFAULT_TARGET_MODULES,
    DENSE_TARGET_MODULES,
    HELP,
    LoraConfig,
    LoraModel,
    partition_rules,
)

# A LoRA run's learning rates from a pretrained base: the QLoRA paper's 2e-4 (7B-13B;
# 1e-4 from 33B), far above full fine-tuning's, since only the adapters move.
LORA_RUN_DEFAULTS = {"optimizer.adamw_optimizer.lr": 2e-4}
# The base is read in bf16 unless kept in fp32: int8/nf4 quantize from it, as QLoRA does
# from bf16/fp16 weights, and a 70B base is never whole in fp32 on a device.
READ_DTYPE = {"fp32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class Host:
    """What a LoRA variant needs of its family's model besides the LoraModel."""

    name: str  # the family's flag section (--<name>.loss_chunk_size)
    rules: PartitionRules  # the float model's partition rules
    head_weight: Callable  # float params -> the output projection (D, V)
    loss_chunk_size: int
    matmul_parameters: int  # N of the base's 6N FLOPs a token


def lora_variant(model: Model, lm: LoraModel, host: Host, load_spec: str, load) -> Model:
    """The LoRA `Model` of `model`: it trains the adapters (`params`) of `lm` on the frozen
    base (`frozen`: --lora.base_dtype, quantized on the devices for int8/nf4), read from
    `load_spec` (hf::, params:: or trainstate_params::; `load(spec, abstract)` reads it)
    or, with none, drawn."""
    chunk = host.loss_chunk_size
    if chunk and any(path.startswith("lm_head/") for path in lm.targets):
        raise UserError(f"--{host.name}.loss_chunk_size computes the output projection outside "
                        f"the model: leave lm_head out of --lora.target_modules, or set "
                        f"--{host.name}.loss_chunk_size=0")

    def apply(adapters, base, rng, collections, *args, **kwargs):
        # Serving (the trainer's lm-eval hook, GRPO's rollouts) runs the live adapters on
        # their stored base: no merged float copy of the base, which for QLoRA would be 4x
        # its nf4 bytes; each matmul dequantizes its kernel as in training. A MoE base's
        # router is frozen, as PEFT leaves it (its kernels are in `base`, where a routing
        # to replay is laid out: `router_params`), but what it sees moves with the
        # adapters: its stats feed the router losses (`Model.router_loss`).
        return lm.apply(base, adapters, *args, rng=rng, collections=collections, **kwargs)

    def head(adapters, base=None):
        return host.head_weight(lm.dequantized_base(base))

    adapter_parameters = lm.num_adapter_parameters()
    return dataclasses.replace(
        model, init_params=lm.init_adapters, apply=apply, head=head,
        router_params=lambda adapters, base: base,
        partition_rules=partition_rules(host.rules),
        frozen=frozen(lm, model, host.rules, load_spec, load), load=None,
        num_parameters=adapter_parameters,
        # No weight gradients for the frozen base: 4 FLOPs a matmul weight, not 6, and
        # the adapters' own 6.
        flops_per_token=lambda seq_length: (model.flops_per_token(seq_length)
                                            - 2 * host.matmul_parameters
                                            + 6 * adapter_parameters),
        # the base's forward pass and the adapters' (2 FLOPs a weight)
        forward_flops_per_token=lambda seq_length: (model.forward_flops(seq_length)
                                                    + 2 * adapter_parameters))


class LoraVariant:
    """What LoRA owns besides its Model (`easylm.variants.build` makes that): its --lora.*
    flags and their help, the run defaults it sets, and the settings a run's adapters mean
    something under. A family offers it by naming it in `ModelFamily.variants`."""

    section = "lora"
    prefix = "lora."  # the flags it owns (run names, ignored flags)

    def flags(self) -> ConfigDict:
        return LoraConfig.get_default_config()

    def help(self) -> dict:
        return {f"lora.{name}": text for name, text in HELP.items()}

    def selected(self, flags: ConfigDict) -> bool:
        lora = flags.get("lora")
        return lora is not None and bool(lora.rank)

    def run_defaults(self, flags: ConfigDict) -> dict:
        """LoRA's learning rate, for adapters on a loaded base."""
        return dict(LORA_RUN_DEFAULTS) if self.selected(flags) and \
            flags.get("load_checkpoint") else {}

    def state_settings(self, flags: dict) -> dict:
        """The --lora.* settings a LoRA run's adapters mean something under, from flat flags
        (rank (0: no adapters), the modules, the scale, the base's storage with auto made
        concrete: it follows --dtype); flags a checkpoint did not record are left out."""
        rank = flags.get("lora.rank", 0)
        settings = {"--lora.rank": rank}
        if not rank:
            return settings
        for name in ("target_modules", "alpha", "use_rslora"):
            if f"lora.{name}" in flags:
                settings[f"--lora.{name}"] = flags[f"lora.{name}"]
        if settings.get("--lora.target_modules") == DENSE_TARGET_MODULES:
            # The old default: the same kernels on a dense model; on a mixture of experts
            # the adapters' shapes (no expert ones) tell the two apart when resuming.
            settings["--lora.target_modules"] = DEFAULT_TARGET_MODULES
        if "lora.base_dtype" in flags and "dtype" in flags:
            lora = LoraConfig(base_dtype=flags["lora.base_dtype"])
            settings["--lora.base_dtype"] = lora.resolved(
                dtype_from_flag("dtype", flags["dtype"])).base_dtype
        return settings


LORA = LoraVariant()


def frozen(lm: LoraModel, model: Model, rules: PartitionRules, load_spec: str, load) -> Frozen:
    lora = lm.config
    return Frozen(
        init=lambda rng: lm.store_base(lm.base_module.init_params(rng)),
        rules=partition_rules(rules),
        load=(lambda mesh: load_base(lm, load_spec, mesh, load, rules)) if load_spec else None,
        identity=lm.identity, adapters_off=lm.adapters_off,
        variant=f"{'QLoRA' if lora.base_dtype == 'nf4' else 'LoRA'} rank {lora.rank}",
        num_parameters=model.num_parameters, dtype=lora.base_dtype)


def load_base(lm: LoraModel, spec: str, mesh, load, rules: PartitionRules):
    """The frozen base of `lm` from `spec` (hf::, params:: or trainstate_params::, in
    either layout: `load(spec, abstract)`), each tensor read into its shards of `mesh`
    (by the float model's `rules`), then stored (cast, or quantized) on the devices."""
    kind, _ = checkpoint.parse_load_spec(spec, checkpoint.LOAD_PREFIXES + ("hf",))
    if kind == "trainstate":
        raise UserError(f"--load_checkpoint={spec}: a LoRA run (--lora.rank="
                        f"{lm.config.rank}) trains adapters on a base: give the base as hf::, "
                        f"params:: or trainstate_params::")
    shapes = jax.eval_shape(lm.base_module.init_params, jax.random.key(0))
    read = READ_DTYPE.get(lm.config.base_dtype, jnp.bfloat16)
    shardings = rule_shardings(mesh, rules, shapes)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, read, sharding=s),
                            shapes, shardings)
    base = load(spec, abstract)
    stored = jax.eval_shape(lm.store_base, shapes)
    out = rule_shardings(mesh, partition_rules(rules), stored)
    return jax.jit(lm.store_base, out_shardings=out, donate_argnums=0)(base)


def check_base(adapters: str, recorded: dict, base_spec: str, lm: LoraModel, stored,
               fix: str) -> None:
    """Refuses a base other than the one the adapters at `adapters` were trained on (its
    `recorded` fingerprint, of `Frozen.identity` of the base as `lm` stored it for
    training: `stored`): one line naming both bases and fingerprints, and `fix`. Serve,
    eval and convert call it."""
    actual = checkpoint.fingerprint(lm.identity(stored))
    if actual != recorded["fingerprint"]:
        raise UserError(f"{adapters} was trained on a frozen base ({recorded['source']}) with "
                        f"fingerprint {recorded['fingerprint']}, but {base_spec} has fingerprint "
                        f"{actual}: {fix}")


def read_adapters(spec: str, load_peft) -> tuple[LoraConfig, dict, dict]:
    """(LoraConfig, adapters on one device as stored, the run's checkpoint metadata ({} for
    PEFT)) from a PEFT directory (`load_peft(directory) -> (LoraConfig, adapters)`, the
    family's names) or a LoRA run's checkpoint (DIR or params::DIR)."""
    import os

    from easylm.variants.lora import PEFT_CONFIG

    directory = spec.partition("::")[2] if "::" in spec else spec
    if os.path.isfile(os.path.join(directory, PEFT_CONFIG)):
        return (*load_peft(directory), {})
    checkpoint.check_checkpoint_dir(directory)
    metadata = checkpoint.read_metadata(directory)
    fields = {name.split(".", 1)[1]: value for name, value in metadata.get("flags", {}).items()
              if name.startswith("lora.")}
    if not fields.get("rank"):
        raise UserError(f"--lora_checkpoint={spec}: neither a PEFT adapter directory nor a "
                        f"LoRA run's checkpoint (its flags have no --lora.rank)")
    return (LoraConfig(**fields), checkpoint.load_stored_params(f"params::{directory}"),
            metadata)


def merge_into(spec: str, base_spec: str, params, lm: LoraModel, adapters, metadata: dict,
               stored_as_the_run):
    """`params` (float, sharded, read from `base_spec`) with `adapters` (of `lm`, read from
    `spec`) folded into their kernels, on the devices and in each kernel's dtype and shards;
    refused unless the base is the one a LoRA run's adapters were trained on
    (`stored_as_the_run(metadata) -> (the run's LoraModel, the base as it stored it)`)."""
    adapters = jax.device_get(adapters)  # small: jit places them beside the kernels
    shardings = jax.tree.map(lambda x: x.sharding, params)
    expected = jax.tree.structure(lm.adapter_shapes)
    if jax.tree.structure(adapters) != expected or any(
            a.shape != b.shape for a, b in zip(jax.tree.leaves(adapters),
                                               jax.tree.leaves(lm.adapter_shapes))):
        raise UserError(f"--lora_checkpoint={spec}: its adapters do not fit the served model "
                        f"(another shape, or other adapted modules)")
    if (metadata.get("frozen") or {}).get("fingerprint"):  # a PEFT directory records none
        check_base(spec, metadata["frozen"], base_spec, *stored_as_the_run(metadata),
                   fix=f"serve the adapters on their base (--load_checkpoint="
                       f"{metadata['frozen']['source']})")
    return jax.jit(lm.merge, out_shardings=shardings)(params, adapters)


def stored_as_the_run(run_lm: LoraModel, params, relayout, reload):
    """(the run's LoraModel, the base as that LoRA run stored it: its layout (`relayout`),
    cast or quantized from the dtype it read): what its fingerprint is of. Made from the
    served `params` when they hold every bit the run read (fp32, or its read dtype), else
    read again (`reload()`); for the check only, then freed."""
    read = jnp.dtype(READ_DTYPE.get(run_lm.config.base_dtype, jnp.bfloat16))
    if any(x.dtype not in (jnp.float32, read) for x in jax.tree.leaves(params)):
        return run_lm, reload()
    as_read = lambda p: jax.tree.map(lambda x: x.astype(read), relayout(p))  # noqa: E731
    return run_lm, jax.jit(lambda p: run_lm.store_base(as_read(p)))(params)
