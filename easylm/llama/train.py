"""Train a LLaMA model: `python -m easylm.llama.train [--flag=value ...]`.

With no flags it trains a small LLaMA on the corpus and tokenizer embedded in
the package, on CPU in a few minutes, and prints how to serve the result: the
embedded demo, whose settings (`EMBEDDED_DEFAULTS`: 200 steps at a peak learning
rate of 3e-3, rows of 256 tokens, 16 a batch) apply only to a run given no data
and no checkpoint. Every other run starts from the usual defaults (10,000 steps,
AdamW peaking at 3e-4, rows of 1024 tokens, 8 a batch; 2e-5 when fine-tuning a
pretrained checkpoint), the schedule always ending with the run. All flags:
`python -m easylm.llama.train --help`; examples in `configs/`.
"""

import sys

import jax
from ml_collections import ConfigDict

from easylm import preference, trainer
from easylm.errors import UserError, exit_on_user_error
from easylm.llama.config import LLAMA_PRESETS, LLaMAConfig
from easylm.llama.convert_hf_to_easylm import load_hf_params, read_hf_config
from easylm.llama.model import PARTITION_RULES, LLaMAForCausalLM, lm_head_weight
from easylm.losses import causal_lm_loss, chunked_next_token_loss
from easylm.sharding import path_to_string

# The embedded demo: the `embedded` preset on the embedded corpus, sized to train in
# about three minutes on two CPU cores (its warmup, 20 steps, and decay, to step 200,
# follow --total_steps as in every run). Only run-level settings here: a
# `--llama.base_model=...` flag must get that preset's shape untouched.
EMBEDDED_DEFAULTS = {
    "train_dataset.json_dataset.seq_length": 256,
    "train_dataset.json_dataset.batch_size": 16,
    "total_steps": 200,
    "log_freq": 25,
    "optimizer.adamw_optimizer.lr": 3e-3,
    "optimizer.adamw_optimizer.end_lr": 3e-4,
}
USAGE = "usage: python -m easylm.llama.train [--flag=value ...]"


def default_config() -> ConfigDict:
    """The flags' defaults before those that depend on the run (`parse_flags`)."""
    from easylm.data import DatasetFactory

    config = trainer.get_default_config(DatasetFactory.get_default_config())
    config.llama = LLaMAConfig.get_default_config()
    config.llama.base_model = "embedded"  # a model from scratch; hf:: gives its own shape
    return config


def parse_flags(argv: list[str]) -> ConfigDict:
    """`argv` (argv[0] is the program) as the command line reads it, defaults of the run
    included."""
    from easylm import flags

    return flags.parse(default_config(), help_entries(), argv, USAGE, derived=RUN_DEFAULTS)


def help_entries() -> dict:
    from easylm.data import DatasetFactory

    entries = trainer.help_text(getattr(DatasetFactory, "HELP", None))
    entries["llama.base_model"] = f"preset: {', '.join(LLAMA_PRESETS)}"
    for name, value in EMBEDDED_DEFAULTS.items():
        entries[name] = f"{entries.get(name, '')} (the embedded demo, given no data and no " \
                        f"checkpoint: {value:g})".strip()
    for field in LLaMAConfig.__dataclass_fields__:
        entries[f"llama.{field}"] = "override the preset's (or hf::DIR config.json's) value"
    return entries


def model_config(config: ConfigDict) -> LLaMAConfig:
    """The `--llama.base_model` preset, or with `--load_checkpoint=hf::DIR` the shape in
    DIR/config.json; then the `--llama.*` fields given on the command line."""
    spec = config.get("load_checkpoint", "")
    if not spec.startswith("hf::"):
        return LLaMAConfig.from_flags(config.llama)
    overrides = {k: v for k, v in config.llama.items() if k != "base_model" and v is not None}
    return read_hf_config(spec[len("hf::"):]).replace(**overrides)


# Rows default to the model's length at most: 1024 tokens do not fit the embedded preset.
RUN_DEFAULTS = trainer.run_defaults(
    EMBEDDED_DEFAULTS, lambda config: model_config(config).max_position_embeddings)


def build_model(config: ConfigDict) -> trainer.Model:
    llama_config = model_config(config)
    model = LLaMAForCausalLM(
        llama_config,
        dtype=trainer.dtype_from_flag("dtype", config.dtype),
        param_dtype=trainer.dtype_from_flag("param_dtype", config.param_dtype),
    )

    def logits(params, batch):  # (B, T, V)
        return model.apply({"params": params}, batch["input_tokens"],
                           positions=batch.get("positions"), segment_ids=batch.get("segment_ids"))

    def chunked_loss(params, batch, rng):  # the same numbers, never all (B, T, V) logits
        del rng
        hidden = model.apply({"params": params}, batch["input_tokens"], positions=batch.get("positions"),
                             segment_ids=batch.get("segment_ids"), return_hidden=True)
        return chunked_next_token_loss(hidden, lm_head_weight(params, llama_config),
                                       batch["target_tokens"], batch["loss_masks"],
                                       llama_config.loss_chunk_size)

    def row_logps(params, rows):  # preference pairs: one sequence per row, never packed
        if not llama_config.loss_chunk_size:
            logits = model.apply({"params": params}, rows["input_tokens"])
            return preference.sequence_logps(logits, rows["target_tokens"], rows["loss_masks"])
        hidden = model.apply({"params": params}, rows["input_tokens"], return_hidden=True)
        return preference.chunked_sequence_logps(
            hidden, lm_head_weight(params, llama_config), rows["target_tokens"],
            rows["loss_masks"], llama_config.loss_chunk_size)

    def load_hf(directory, abstract_params):
        """DIR's tensors, each placed straight into its shards of `abstract_params` (host
        memory: one copy of the model; each device: its shards)."""
        _, host = load_hf_params(directory, scan_layers=llama_config.scan_layers)
        if jax.tree.structure(host) != jax.tree.structure(abstract_params):
            raise UserError(f"{directory}: the --llama.* flags describe a model with other "
                            f"parameters than its config.json")

        def place(path, array, target):
            if array.shape != target.shape:
                raise UserError(f"{directory}: parameter {path_to_string(path)} has shape "
                                f"{array.shape}, but the --llama.* flags imply {target.shape}")
            array = array.astype(target.dtype)
            return jax.make_array_from_callback(target.shape, target.sharding, lambda i: array[i])

        return jax.tree_util.tree_map_with_path(place, host, abstract_params)

    def engine_fns():  # the serving model, computing in the training dtype
        from easylm.llama.serve import llama_model_fns

        return llama_model_fns(llama_config.replace(remat_policy="none"), model.dtype,
                               model.param_dtype)[0]

    return trainer.Model(
        name="llama",
        config=llama_config.to_dict(),
        vocab_size=llama_config.vocab_size,
        init_params=model.init_params,
        loss_fn=causal_lm_loss(logits) if not llama_config.loss_chunk_size else chunked_loss,
        partition_rules=PARTITION_RULES,
        flops_per_token=llama_config.flops_per_token,
        serve_module="easylm.llama.serve",
        load_hf=load_hf,
        max_seq_length=llama_config.max_position_embeddings,
        row_logps=row_logps,
        engine_fns=engine_fns,
        stop_token_ids=(llama_config.eos_token_id,) if llama_config.eos_token_id is not None else (),
    )


@exit_on_user_error
def main(argv=None):
    trainer.main(argv or sys.argv, default_config(), help_entries(), build_model, USAGE,
                 derived=RUN_DEFAULTS)


if __name__ == "__main__":
    main()
