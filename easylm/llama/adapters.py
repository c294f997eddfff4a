"""LLaMA with LoRA adapters (easylm/variants/lora.py), and PEFT adapter directories for it.

qwix adapts the matmul that reads a module's own kernel. The fused q/k/v and gate/up
matmuls (`--llama.fused_qkv/fused_mlp`) read a concatenation of kernels instead, so a
LoRA model computes them unfused: the same numbers (the config's implementation
choices change none), and every projection gets its adapters.
"""

import dataclasses

import jax
import jax.numpy as jnp

from easylm.errors import UserError
from easylm.llama import hf
from easylm.llama.config import LLaMAConfig
from easylm.llama.model import PARTITION_RULES, LLaMAForCausalLM, lm_head_weight, relayout
from easylm.models.family import Frozen, Model
from easylm.objectives import preference
from easylm.objectives.next_token import chunked_next_token_loss, next_token_loss
from easylm.runtime import checkpoint
from easylm.runtime.dtypes import dtype_from_flag
from easylm.runtime.sharding import match_partition_rules, named_shardings
from easylm.variants.lora import (
    LoraConfig,
    LoraModel,
    partition_rules,
    read_peft,
    write_peft,
)

# A LoRA run's learning rates from a pretrained base: the QLoRA paper's 2e-4 (7B-13B;
# 1e-4 from 33B), far above full fine-tuning's, since only the adapters move.
LORA_RUN_DEFAULTS = {"optimizer.adamw_optimizer.lr": 2e-4}
# The base is read in bf16 unless kept in fp32: int8/nf4 quantize from it, as QLoRA does
# from bf16/fp16 weights, and a 70B base is never whole in fp32 on a device.
_READ_DTYPE = {"fp32": jnp.float32}


def lora_model(config: LLaMAConfig, lora: LoraConfig, dtype=jnp.float32,
               param_dtype=jnp.float32) -> LoraModel:
    module = LLaMAForCausalLM(config.replace(fused_qkv=False, fused_mlp=False), dtype=dtype,
                              param_dtype=param_dtype)
    return LoraModel(module, lora, dtype)


def lora_variant(model: Model, config: LLaMAConfig, lora: LoraConfig, dtype, load_spec: str,
                 load) -> Model:
    """The LoRA `Model` of the LLaMA `model` (bound to `config`, compute `dtype`): it trains
    the adapters (`params`) on the frozen base (`frozen`: `lora.base_dtype`, quantized on
    the devices for int8/nf4), read from `load_spec` (hf::, params:: or trainstate_params::;
    `load(spec, abstract)` reads it) or, with none, drawn."""
    lm = lora_model(config, lora, dtype=dtype)
    head_adapted = any(path.startswith("lm_head/") for path in lm.targets)
    if config.loss_chunk_size and head_adapted:
        raise UserError("--llama.loss_chunk_size computes the output projection outside the "
                        "model: leave lm_head out of --lora.target_modules, or set "
                        "--llama.loss_chunk_size=0")

    def forward(adapters, batch, rng, base, **kwargs):
        return lm.apply(base, adapters, batch["input_tokens"], positions=batch.get("positions"),
                        segment_ids=batch.get("segment_ids"), rng=rng, **kwargs)

    def loss_fn(adapters, batch, rng, base):
        if not config.loss_chunk_size:
            return next_token_loss(forward(adapters, batch, rng, base), batch["target_tokens"],
                                   batch["loss_masks"])
        hidden = forward(adapters, batch, rng, base, return_hidden=True)
        head = lm_head_weight(lm.dequantized_base(base), config)
        return chunked_next_token_loss(hidden, head, batch["target_tokens"], batch["loss_masks"],
                                       config.loss_chunk_size)

    def row_logps(adapters, rows, base, rng=None):  # preference pairs, one per row
        if not config.loss_chunk_size:
            logits = lm.apply(base, adapters, rows["input_tokens"], rng=rng)
            return preference.sequence_logps(logits, rows["target_tokens"], rows["loss_masks"])
        hidden = lm.apply(base, adapters, rows["input_tokens"], rng=rng, return_hidden=True)
        return preference.chunked_sequence_logps(
            hidden, lm_head_weight(lm.dequantized_base(base), config), rows["target_tokens"],
            rows["loss_masks"], config.loss_chunk_size)

    def apply(adapters_and_base, ids, positions, cache):
        # The engine on the live adapters and their stored base (the trainer's lm-eval
        # hook): no merged float copy of the base, which for QLoRA would be 4x its nf4
        # bytes; each matmul dequantizes its kernel as in training.
        adapters, base = adapters_and_base
        return lm.apply(base, adapters, ids, positions=positions, cache=cache)

    return dataclasses.replace(
        model, init_params=lm.init_adapters, loss_fn=loss_fn,
        partition_rules=partition_rules(PARTITION_RULES), row_logps=row_logps,
        frozen=_frozen(lm, model, load_spec, load), load=None, apply=apply,
        num_parameters=lm.num_adapter_parameters(),
        # No weight gradients for the frozen base: 4 FLOPs a matmul weight, not 6, and
        # the adapters' own 6.
        flops_per_token=lambda seq_length: (model.flops_per_token(seq_length)
                                            - 2 * config.num_matmul_parameters()
                                            + 6 * lm.num_adapter_parameters()),
        # the base's forward pass and the adapters' (2 FLOPs a weight)
        forward_flops_per_token=lambda seq_length: (model.forward_flops(seq_length)
                                                    + 2 * lm.num_adapter_parameters()))


def state_settings(flags: dict) -> dict:
    """The --lora.* settings a LoRA run's adapters mean something under, from flat flags
    (`ModelFamily.state_settings`); flags a checkpoint did not record are left out."""
    rank = flags.get("lora.rank", 0)
    settings = {"--lora.rank": rank}
    if not rank:
        return settings
    for name in ("target_modules", "alpha", "use_rslora"):
        if f"lora.{name}" in flags:
            settings[f"--lora.{name}"] = flags[f"lora.{name}"]
    if "lora.base_dtype" in flags and "dtype" in flags:
        lora = LoraConfig(base_dtype=flags["lora.base_dtype"])
        settings["--lora.base_dtype"] = lora.resolved(
            dtype_from_flag("dtype", flags["dtype"])).base_dtype  # auto made concrete
    return settings


def _frozen(lm: LoraModel, model: Model, load_spec: str, load) -> Frozen:
    lora = lm.config
    return Frozen(
        init=lambda rng: lm.store_base(lm.base_module.init_params(rng)),
        rules=partition_rules(PARTITION_RULES),
        load=(lambda mesh: load_base(lm, load_spec, mesh, load)) if load_spec else None,
        identity=lm.identity, adapters_off=lm.adapters_off,
        variant=f"{'QLoRA' if lora.base_dtype == 'nf4' else 'LoRA'} rank {lora.rank}",
        num_parameters=model.num_parameters, dtype=lora.base_dtype)


def load_base(lm: LoraModel, spec: str, mesh, load):
    """The frozen base of `lm` from `spec` (hf::, params:: or trainstate_params::, in
    either layout: `load(spec, abstract)`), each tensor read into its shards of `mesh`,
    then stored (cast, or quantized) on the devices."""
    kind, _ = checkpoint.parse_load_spec(spec, checkpoint.LOAD_PREFIXES + ("hf",))
    if kind == "trainstate":
        raise UserError(f"--load_checkpoint={spec}: a LoRA run (--lora.rank="
                        f"{lm.config.rank}) trains adapters on a base: give the base as hf::, "
                        f"params:: or trainstate_params::")
    rules = partition_rules(PARTITION_RULES)
    shapes = jax.eval_shape(lm.base_module.init_params, jax.random.key(0))
    read = _READ_DTYPE.get(lm.config.base_dtype, jnp.bfloat16)
    shardings = named_shardings(mesh, match_partition_rules(PARTITION_RULES, shapes))
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, read, sharding=s),
                            shapes, shardings)
    base = load(spec, abstract)
    stored = jax.eval_shape(lm.store_base, shapes)
    out = named_shardings(mesh, match_partition_rules(rules, stored))
    return jax.jit(lm.store_base, out_shardings=out, donate_argnums=0)(base)


def read_adapters(spec: str, config: LLaMAConfig) -> tuple[LoraConfig, dict, dict]:
    """(LoraConfig, adapters on one device, the run's checkpoint metadata ({} for PEFT))
    from a PEFT directory or a LoRA run's checkpoint (DIR or params::DIR): read in the
    layout they were stored in, returned in `config`'s (serve, eval and convert all read
    adapters here)."""
    import os

    from easylm.variants.lora import PEFT_CONFIG

    directory = spec.partition("::")[2] if "::" in spec else spec
    if os.path.isfile(os.path.join(directory, PEFT_CONFIG)):
        return (*load_peft(directory, config), {})
    checkpoint.check_checkpoint_dir(directory)
    metadata = checkpoint.read_metadata(directory)
    fields = {name.split(".", 1)[1]: value for name, value in metadata.get("flags", {}).items()
              if name.startswith("lora.")}
    if not fields.get("rank"):
        raise UserError(f"--lora_checkpoint={spec}: neither a PEFT adapter directory nor a "
                        f"LoRA run's checkpoint (its flags have no --lora.rank)")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype,
                                                              sharding=device),
                            checkpoint.stored_tree(directory, "params"))
    adapters = checkpoint.load_params(f"params::{directory}", abstract)
    return LoraConfig(**fields), relayout(adapters, config.scan_layers), metadata


def merge_into(spec: str, base_spec: str, config: LLaMAConfig, params, mesh, load):
    """`params` (float, sharded, read from `base_spec` by `load(spec, abstract)`) with the
    adapters at `spec` folded into their kernels, on the devices and in each kernel's dtype
    and shards; refused unless the base is the one a LoRA run's adapters were trained on."""
    lora, adapters, metadata = read_adapters(spec, config)
    adapters = jax.device_get(adapters)  # small: jit places them beside the kernels
    lm = lora_model(config, lora)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    expected = jax.tree.structure(lm.adapter_shapes)
    if jax.tree.structure(adapters) != expected or any(
            a.shape != b.shape for a, b in zip(jax.tree.leaves(adapters),
                                               jax.tree.leaves(lm.adapter_shapes))):
        raise UserError(f"--lora_checkpoint={spec}: its adapters do not fit the served model "
                        f"(another shape, or other adapted modules)")
    if (metadata.get("frozen") or {}).get("fingerprint"):  # a PEFT directory records none
        check_base(spec, metadata["frozen"], base_spec,
                   *_stored_as_the_run(metadata, lora, params, base_spec, mesh, load),
                   fix=f"serve the adapters on their base (--load_checkpoint="
                       f"{metadata['frozen']['source']})")
    return jax.jit(lm.merge, out_shardings=shardings)(params, adapters)


def _stored_as_the_run(metadata: dict, lora: LoraConfig, params, base_spec: str, mesh, load):
    """(LoraModel of the run, the base as the LoRA run whose `metadata` these are stored it:
    its layout, cast or quantized from the dtype it read): what its fingerprint is of. Made
    from the served `params` when they hold every bit the run read (fp32, or its read
    dtype), else read again from `base_spec`; for the check only, then freed."""
    recorded = metadata["frozen"]
    run_config = LLaMAConfig(**metadata["llama_config"])
    lm = lora_model(run_config, lora, dtype=jnp.dtype(recorded.get("dtype", "float32")))
    read = jnp.dtype(_READ_DTYPE.get(lm.config.base_dtype, jnp.bfloat16))  # auto resolved
    if any(x.dtype not in (jnp.float32, read) for x in jax.tree.leaves(params)):
        return lm, load_base(lm, base_spec, mesh, load)
    as_read = lambda p: jax.tree.map(lambda x: x.astype(read), relayout(p, run_config.scan_layers))
    return lm, jax.jit(lambda p: lm.store_base(as_read(p)))(params)


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


def save_peft(directory: str, lm: LoraModel, adapters, config: LLaMAConfig,
              base_model: str = "") -> None:
    """`adapters` as a PEFT directory that `peft.PeftModel.from_pretrained` loads onto
    the HF LlamaForCausalLM of the same base."""
    unscanned = config.replace(scan_layers=False)
    kernels = [path for path in hf.param_shapes(unscanned)
               if _scanned(path, config) in lm.targets]
    write_peft(directory, hf.to_peft(adapters, config), lm.config,
               hf.peft_target_modules(kernels, unscanned), base_model)


def load_peft(directory: str, config: LLaMAConfig) -> tuple[LoraConfig, dict]:
    """(LoraConfig, adapters) from a PEFT directory (ours or peft's own), shaped for
    `config` (scanned or not); the config selects the modules the file adapts."""
    lora, tensors = read_peft(directory)
    adapters, pattern = hf.from_peft(tensors, config, lora.rank, source=directory)
    return dataclasses.replace(lora, target_modules=pattern), adapters


def _scanned(path: str, config: LLaMAConfig) -> str:
    """model/layers/<i>/... -> model/layers/... when the config scans layers."""
    if config.scan_layers and path.startswith("model/layers/"):
        _, _, _, rest = path.split("/", 3)
        return f"model/layers/{rest}"
    return path
