"""The trainer's flags: their defaults and help, the defaults that depend on the run (the
embedded demo, fine-tuning rates, rows no longer than the model takes, a schedule that
ends with the run), the run directory named after the flags, and the checks of a
configuration before anything starts."""

import functools
import hashlib
import json
import os
from typing import Callable

from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder

from easylm import flags as flag_lib, model_flags, objectives, variants
from easylm.data.options import loader_block
from easylm.errors import UserError
from easylm.evaluation import harness_flags
from easylm.models.config import ModelConfig
from easylm.models.context_parallel import STRATEGIES
from easylm.models.family import Model, ModelFamily
from easylm.runtime import checkpoint, distributed, easylm_flags, run_flags
from easylm.training import logger, optimizers
from easylm.variants.lora import DEFAULT_TARGET_MODULES, DENSE_TARGET_MODULES

LOAD_PREFIXES = checkpoint.LOAD_PREFIXES + ("hf",)

HELP = {
    **run_flags.help_entries(*run_flags.DEFAULTS, load_checkpoint=(
        "trainstate:: also restores the optimizer and the step; empty: from scratch")),
    "dcn_mesh_dim": "hybrid mesh: how TPU slices (GPU/CPU: processes) combine, dp,fsdp,mp "
                    "or named sizes as --mesh_dim; --mesh_dim then splits the devices of one slice/process (empty: flat mesh)",
    "context_parallel": "attention over a sequence split by --mesh_dim's sp > 1: ring (K/V "
                        "blocks passed round, the least memory) or all_gather (K/V gathered "
                        "per layer); unset: ring (docs/long_context.md)",
    "log_all_worker": "every process logs (metrics.process<i>.jsonl), not only process 0",
    "total_steps": "number of optimizer updates to train for",
    "log_freq": "log metrics every this many steps (the only time the host waits "
                "for the device)",
    "save_model_freq": "save a checkpoint every this many steps, keeping the latest "
                       "--checkpointer.keep (0: only the final one)",
    "save_milestone_freq": "save a checkpoint every this many steps that is never deleted "
                           "(0: none)",
    "eval_freq": "evaluate on --eval_dataset every this many steps (0: never)",
    "eval_steps": "batches per evaluation (0: one full pass over --eval_dataset)",
    "resume": "continue from the newest complete checkpoint in the run directory, if any",
    "load_dataset_state": "EasyLM's: start the data where a saved state says: a checkpoint "
                          "directory (its data) or a JSON file of one; a run resuming its "
                          "own checkpoint continues its own ('': from the start)",
    "allow_fresh_optimizer": "resume from a checkpoint without optimizer state (saved with "
                             "--checkpointer.save_optimizer_state=False) with a fresh "
                             "optimizer, instead of stopping",
    "peak_tflops": "peak TFLOP/s of one device for MFU (0: look the device up; unknown "
                   "devices such as CPUs report MFU as n/a)",
    "compilation_cache_dir": "persistent XLA compilation cache: a second start of the same "
                             "step skips compiling ('' to disable)",
    "skip_nonfinite_updates": "skip updates whose loss or gradient norm is NaN/Inf and count "
                              "them, instead of stopping the run",
    "profile_steps": "trace this many steps with the jax profiler into RUN_DIR/profile/"
                     "process<i> (--logger.wandb_dir, when set, instead of RUN_DIR); 0: off",
    "profile_start_step": "the first traced step (steps count from 1; the first one compiles)",
}


def get_default_config(dataset_config: ConfigDict | None = None,
                       objective: str | None = None) -> ConfigDict:
    """Top-level flags and each component's own block (`--optimizer.*`, ...); `objective`:
    an --objective=MODULE:CLASS whose flags join the registered objectives'."""
    config = run_flags.get_default_config(*run_flags.DEFAULTS)
    config.dcn_mesh_dim = ""
    config.context_parallel = placeholder(str)  # None: ring, and left out of the run's id
    config.total_steps = 10000
    config.log_freq = 50
    config.save_model_freq = 0
    config.save_milestone_freq = 0
    config.eval_freq = 0
    config.eval_steps = 0
    config.resume = True
    config.load_dataset_state = placeholder(str)  # None: left out of the run's id
    config.allow_fresh_optimizer = False
    config.peak_tflops = 0.0
    config.compilation_cache_dir = "~/.cache/easylm/jax"
    config.skip_nonfinite_updates = False
    config.profile_steps = 0
    config.profile_start_step = 5
    config.log_all_worker = False
    config.update(objectives.get_default_config(objective))  # --objective, --dpo.*, ...
    if dataset_config is not None:
        config.train_dataset = dataset_config
        config.eval_dataset = ConfigDict(dataset_config.to_dict())
    config.optimizer = optimizers.get_default_config()
    config.checkpointer = checkpoint.get_default_config()
    config.logger = logger.get_default_config()
    config.jax_distributed = distributed.get_default_config()
    config.eval_harness = harness_flags.get_default_config()
    config.update_from_flattened_dict(_schedule_defaults(config))
    return config


def help_text(dataset_help: dict | None = None, objective: str | None = None) -> dict:
    text = dict(HELP)
    sections = {"optimizer": optimizers.HELP, "checkpointer": checkpoint.HELP,
                "logger": logger.HELP, "jax_distributed": distributed.HELP,
                "eval_harness": harness_flags.HELP}
    text.update(objectives.help_entries(objective))
    for section in ("train_dataset", "eval_dataset"):
        sections[section] = dataset_help or {}
    for section, entries in sections.items():
        text.update({f"{section}.{name}": entry for name, entry in entries.items()})
    for name, default in RUN_DEFAULTS_HELP.items():
        text[name] = f"{text.get(name, '')} ({default})".strip()
    return text


def default_config(family: ModelFamily, objective: str | None = None) -> ConfigDict:
    """`family`'s training flags before those that depend on the run (`run_defaults`);
    `objective`: as in `get_default_config`."""
    from easylm.data import DatasetFactory

    config = get_default_config(DatasetFactory.get_default_config(), objective)
    config[family.name] = model_flags.flag_config(family)  # from scratch; hf:: gives its own shape
    for section, block in variants.flag_sections(family).items():
        config[section] = block
    return config


def help_entries(family: ModelFamily, objective: str | None = None) -> dict:
    from easylm.data import DatasetFactory

    entries = help_text(getattr(DatasetFactory, "HELP", None), objective)
    entries.update(model_flags.help_entries(family, "the preset's, or hf::DIR config.json's"))
    entries.update(variants.help_entries(family))
    for name, value in family.demo.items():
        entries[name] = f"{entries.get(name, '')} (the embedded demo, given no data and no " \
                        f"checkpoint: {value:g})".strip()
    return entries


def family_run_defaults(family: ModelFamily) -> list[Callable[[ConfigDict], dict]]:
    """`run_defaults` for `family`: its demo; rows no longer than its model takes (1024
    tokens do not fit a small preset)."""
    def longest_row(config):
        return family.bind(model_flags.model_config(family, config)).max_seq_length

    return run_defaults(family.demo, longest_row,
                        functools.partial(variants.run_defaults, family))


def common_flags(family: ModelFamily) -> list[str]:
    """What `--help` shows, the flags most runs change, in the order one sets them."""
    data = [f"train_dataset.{name}" for name in (
        "type", "json_dataset.path", "json_dataset.seq_length", "json_dataset.batch_size",
        "huggingface_dataset.path")]
    return ["load_checkpoint", f"{family.name}.base_model", "tokenizer", *data, "total_steps",
            "optimizer.adamw_optimizer.lr", "mesh_dim", "dtype", "log_freq", "save_model_freq",
            "eval_freq", "eval_dataset.json_dataset.path", "logger.output_dir",
            "logger.experiment_id", "resume"]


def usage(family: ModelFamily) -> str:
    command = model_flags.command(family, "train")
    return (f"Train a {family.name} model (from scratch, or fine-tune a checkpoint).\n\n"
            f"  {command} --{family.name}.base_model={family.default_preset} "
            f"--train_dataset.json_dataset.path=data.jsonl --total_steps=1000\n\n"
            f"usage: {command} [--flag=value ...]  (all flags: --helpfull)")


def parse_flags(family: ModelFamily, argv: list[str]) -> ConfigDict:
    """`argv` (argv[0] is the program) as `python -m <family>.train` reads it, the
    defaults of the run included."""
    objective = objectives.named_in(argv)  # MODULE:CLASS brings its own flags
    config = default_config(family, objective)
    common = [name for name in common_flags(family) if name in flag_lib.flatten(config)]
    return flag_lib.parse(config, help_entries(family, objective), argv, usage(family),
                          derived=family_run_defaults(family), common=common,
                          aliases=easylm_flags.train_aliases(family),
                          absent=variants.absent_sections(family))


# ------------------------------------------------------------ defaults of a run
# Some defaults depend on the run; `flags.parse(..., derived=run_defaults(demo))` applies
# them to the flags not given, in this order.

# Full fine-tuning of a pretrained model at a higher peak rate tends to diverge (the
# embedded demo's 3e-3 drove a 135M model's perplexity from 144 to 296 in 22 steps).
FINE_TUNING_MAX_LR = 1e-4
FINE_TUNING_DEFAULTS = {"optimizer.adamw_optimizer.lr": 2e-5}
RUN_DEFAULTS_HELP = {
    "optimizer.adamw_optimizer.lr": "from a pretrained params::, trainstate_params:: or hf:: "
                                    "--load_checkpoint: "
                                    f"{FINE_TUNING_DEFAULTS['optimizer.adamw_optimizer.lr']:g}",
    "optimizer.adamw_optimizer.end_lr": "default: a tenth of the peak lr",
    "optimizer.adamw_optimizer.lr_warmup_steps": "default: a tenth of --total_steps, at most 2000",
    "optimizer.adamw_optimizer.lr_decay_steps": "default: --total_steps",
    **{f"train_dataset.{loader}.seq_length": "default: 1024, or the model's "
                                             "max_position_embeddings if smaller"
       for loader in ("json_dataset", "huggingface_dataset", "cache", "mixture")},
    **{f"eval_dataset.{loader}.{field}": f"default: --train_dataset's {field}"
       for loader in ("json_dataset", "huggingface_dataset", "cache", "mixture")
       for field in ("seq_length", "batch_size")},
}


def is_demo(config: ConfigDict) -> bool:
    """No data and no checkpoint given: the embedded corpus, from scratch."""
    return (not config.load_checkpoint and config.train_dataset.type == "json"
            and config.train_dataset.json_dataset.path == "embedded")


def starts_from_pretrained(config: ConfigDict) -> bool:
    """Pretrained parameters with a fresh optimizer: fine-tuning."""
    return config.load_checkpoint.partition("::")[0] in ("params", "trainstate_params", "hf")


def _schedule_defaults(config: ConfigDict) -> dict:
    # The decay ends at a tenth of the peak, whichever sets the peak (a flag, a fine-tuning
    # or a variant's default): a peak given below another rule's end_lr would rise.
    steps = config.total_steps
    return {"optimizer.adamw_optimizer.lr_warmup_steps": min(2000, steps // 10),
            "optimizer.adamw_optimizer.lr_decay_steps": steps,
            # the decimal tenth (3e-4, not 3.0000000000000003e-05), as a flag would give it
            "optimizer.adamw_optimizer.end_lr":
                float(f"{config.optimizer.adamw_optimizer.lr / 10:.12g}")}


def run_defaults(demo: dict, max_seq_length: Callable[[ConfigDict], int] | None = None,
                 variant: Callable[[ConfigDict], dict] | None = None
                 ) -> list[Callable[[ConfigDict], dict]]:
    """For `flags.parse(derived=...)`: the embedded demo's settings (`demo`, from the model
    family) for a run given no data and no checkpoint; a fine-tuning learning rate from a
    pretrained checkpoint, then a variant's own (`variant(config)`: easylm.variants'
    `run_defaults`); rows no longer than the model takes (`max_seq_length(config)`, from
    the family); a schedule that ends with the run; eval rows shaped like the train rows."""

    def rows(config):
        if max_seq_length is None:
            return {}
        try:
            limit = max_seq_length(config)
        except UserError:
            return {}  # a bad checkpoint or preset: the trainer reports it
        name = f"train_dataset.{loader_block(config.train_dataset)}.seq_length"
        return {name: min(flag_lib.get(config, name), limit)}

    def eval_rows(config):
        train = config.train_dataset[loader_block(config.train_dataset)]
        loader = loader_block(config.eval_dataset)
        return {f"eval_dataset.{loader}.seq_length": train.seq_length,
                f"eval_dataset.{loader}.batch_size": train.batch_size}

    return [lambda config: dict(demo) if is_demo(config) else {},
            lambda config: dict(FINE_TUNING_DEFAULTS) if starts_from_pretrained(config) else {},
            variant or (lambda config: {}), rows, _schedule_defaults, eval_rows,
            objectives.dataset_defaults]


# Flags whose default changed after runs were named by their hash: (new default, old
# default). At the new default the hash reads the old one, so the same command still lands
# in (and resumes) the directory it made before: with a tokenizer that adds BOS, `auto` is
# the old `true`; with --dtype=bf16 the base's `auto` is the old `bf16`; otherwise the
# resume names the setting that differs.
_REDEFAULTED = {"train_dataset.text_processor.add_bos_token": ("auto", True),
                "eval_dataset.text_processor.add_bos_token": ("auto", True),
                "lora.base_dtype": ("auto", "bf16"),
                # experts adapted too: the same kernels on a dense model
                "lora.target_modules": (DEFAULT_TARGET_MODULES, DENSE_TARGET_MODULES),
                # DeepSeek-V3's routing bias and Gemma 4's layer_scalar (a constant of the
                # checkpoint) left undecayed: no other model has the parameters
                **{f"optimizer.{name}_optimizer.weight_decay_exclusions":
                   ("norm,embed,e_score_correction_bias,layer_scalar", "norm,embed")
                   for name in ("adamw", "palm")},
                # our decode kernel: on a TPU the same rows as JAX's to float rounding,
                # off a TPU the same XLA path
                "grpo.decode_kernel": ("batched", "rpa")}


# Flags added after runs were named by their hash, with the value that trains as before
# their time: at that value they are left out of the hash.
_ADDED = {"grpo.dynamic_sampling": False, "grpo.max_sampling_rounds": 4,
          # multi-turn: single-turn without tools or an environment
          "grpo.tools": "", "grpo.environment": "", "grpo.tool_timeout": 10.0,
          "grpo.max_turns": 4,
          # a group's prompt prefilled once: the same rows as each copy prefilled
          "grpo.share_prompts": True,
          # the rollouts' cache dense: the rows and samples a paged cache gives too
          "grpo.page_size": 0,
          # decoding through gathered windows: the rows decoding from the pages gives too
          "grpo.decode_from_pages": False,
          # JAX's kernel (off a TPU both kernels run the same XLA path)
          "grpo.decode_kernel": "rpa",
          # every row over its own page table: the same rows to float rounding
          "grpo.shared_prefix_attention": False}


def _hashed(name: str, value):
    new, old = _REDEFAULTED.get(name, (None, None))
    return old if new is not None and value == new else value


def run_directory(config: ConfigDict, model_name: str, unused: tuple = ()) -> str:
    """OUTPUT_DIR/EXPERIMENT_ID; by default the id hashes the flags, so re-running the
    same command (say, after preemption) lands in the same directory and resumes. Flags
    that do not change what is trained (resuming, logging, profiling; the prefixes
    `unused`: a variant's flags when it is off) are left out."""
    experiment_id = config.logger.experiment_id
    if not experiment_id:
        # logger.* and jax_distributed.* may differ between hosts; unset optional flags
        # (None) are left out too, so that adding such a flag keeps existing ids; and what
        # eval_harness.* evaluates changes nothing trained.
        flat = {k: _hashed(k, v) for k, v in flag_lib.flatten(config).items()
                if k not in ("resume", "allow_fresh_optimizer", "log_all_worker",
                             "profile_steps", "profile_start_step")
                and not k.startswith(("logger.", "jax_distributed.", "eval_harness.",
                                      *objectives.unused_flags(config), *unused,
                                      *optimizers.unused_flags(config.optimizer)))
                and v is not None and not (k in _ADDED and _hashed(k, v) == _ADDED[k])}
        digest = hashlib.sha1(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:8]
        experiment_id = f"{model_name}-{digest}"
    return checkpoint.absolute_path(os.path.join(config.logger.output_dir, experiment_id))


def check_config(config: ConfigDict):
    objectives.check_config(config)
    if config.load_checkpoint:
        kind, directory = checkpoint.parse_load_spec(config.load_checkpoint, LOAD_PREFIXES)
        if kind != "hf":  # the model family reads (and checks) a HF directory
            checkpoint.check_checkpoint_dir(directory)
    if config.context_parallel not in (None, *STRATEGIES):
        raise UserError(f"--context_parallel={config.context_parallel!r}; expected one of "
                        f"{', '.join(STRATEGIES)}")
    if config.total_steps < 1:
        raise UserError(f"--total_steps must be >= 1, got {config.total_steps}")
    if config.log_freq < 1:
        raise UserError(f"--log_freq must be >= 1, got {config.log_freq}")
    if config.profile_start_step < 1:
        raise UserError(f"--profile_start_step must be >= 1, got {config.profile_start_step}")
    for name in ("save_model_freq", "save_milestone_freq", "eval_freq", "eval_steps",
                 "profile_steps"):
        if config[name] < 0:
            raise UserError(f"--{name} must be >= 0, got {config[name]}")
    embedded = lambda c: c.type == "json" and c.json_dataset.path == "embedded"
    if config.eval_freq and embedded(config.eval_dataset) and not embedded(config.train_dataset):
        raise UserError(
            f"--eval_freq={config.eval_freq} evaluates on --eval_dataset, which is not set (it "
            f"would be the embedded demo corpus, not your data): set "
            f"--eval_dataset.json_dataset.path (or --eval_dataset.type=huggingface and its "
            f"huggingface_dataset.path), or --eval_freq=0")


def check_seq_length(config: ConfigDict, model: Model, datasets: dict):
    for section, dataset in datasets.items():
        if dataset is not None and model.max_seq_length and dataset.seq_length > model.max_seq_length:
            flag = f"--{section}.{loader_block(config[section])}.seq_length"
            raise UserError(
                f"{flag}={dataset.seq_length} is above the model's max_position_embeddings="
                f"{model.max_seq_length}: lower {flag}, or raise --{model.name}."
                f"max_position_embeddings if the model can take longer rows")
        chunk = model.loss_chunk_size
        if dataset is not None and chunk and dataset.seq_length % chunk:
            flag = f"--{section}.{loader_block(config[section])}.seq_length"
            raise UserError(f"--{model.name}.loss_chunk_size={chunk} must divide the rows' "
                            f"length, {flag}={dataset.seq_length}")


def mesh_problems(config: ConfigDict, model_config: ModelConfig, mesh_shape,
                  seq_lengths: dict) -> list[str]:
    """What the mesh must divide, one line each, before anything is traced (the trainer
    refuses the first, `python -m easylm.doctor` lists them all): rows that split over sp
    in zig-zag order and a ring's two sub-blocks per device (a multiple of 2*sp), experts
    that split over ep, and a --context_parallel that has a sequence to split.
    `seq_lengths`: {'train_dataset': length, ...} of the rows the run reads."""
    sp, ep, problems = mesh_shape.get("sp", 1), mesh_shape.get("ep", 1), []
    if config.context_parallel and sp == 1:
        problems.append(f"--context_parallel={config.context_parallel} does nothing on "
                        f"--mesh_dim={config.mesh_dim}, which does not split the sequence "
                        f"(sp=1): add sp=N to --mesh_dim, or leave --context_parallel unset")
    for section, length in seq_lengths.items():
        if sp > 1 and length % (2 * sp):
            flag = f"--{section}.{loader_block(config[section])}.seq_length"
            problems.append(f"{flag}={length} must be a multiple of 2*sp = {2 * sp} to split "
                            f"rows over --mesh_dim={config.mesh_dim}")
    experts = model_config.routed_experts  # 0: a dense model, nothing to split
    if experts % ep:
        problems.append(f"--{model_config.section}.{model_config.routed_experts_field}="
                        f"{experts} experts cannot be split over ep={ep} of --mesh_dim="
                        f"{config.mesh_dim}: give a number of experts that ep divides, or "
                        f"another ep")
    return problems


def warn_about_ignored_flags(config: ConfigDict, family: ModelFamily, print_fn):
    """Flags set away from their defaults that this run never reads: another objective's
    (--dpo.beta with --objective=next_token), an unselected variant's (--lora.alpha with
    --lora.rank=0). Training goes on (a shared flag file may hold them); the user is told."""
    defaults = flag_lib.flatten(default_config(family, config.objective))
    why = {f"{name}.": f"only --objective={name} reads it, this run trains "
                       f"--objective={config.objective}"
           for name in objectives.other_sections(config)}
    why.update({prefix: f"the {prefix[:-1]} variant is off"
                for prefix in variants.unused_flags(family, config)})
    for name, value in flag_lib.flatten(config).items():
        prefix = next((p for p in why if name.startswith(p)), None)
        if prefix and name in defaults and value != defaults[name]:
            print_fn(f"warning: --{name}={value} is ignored: {why[prefix]}")


def warn_about_the_schedule(config: ConfigDict, schedule, print_fn, variant: dict | None = None):
    """A fine-tuning learning rate too high for a pretrained model, and a decay that does
    not end with the run: both train, but rarely as meant."""
    if config.optimizer.type != "adamw":
        return
    c = config.optimizer.adamw_optimizer
    if starts_from_pretrained(config) and c.lr > FINE_TUNING_MAX_LR and \
            "optimizer.adamw_optimizer.lr" not in (variant or {}):
        print_fn(f"warning: fine-tuning {config.load_checkpoint} at a peak learning rate of "
                 f"{c.lr:g}, above the {FINE_TUNING_MAX_LR:g} a pretrained model usually "
                 f"tolerates (full fine-tuning uses about 1e-5 to 5e-5): lower "
                 f"--optimizer.adamw_optimizer.lr if the loss rises")
    if c.lr_decay_steps != config.total_steps:
        print_fn(f"note: --optimizer.adamw_optimizer.lr_decay_steps={c.lr_decay_steps} but "
                 f"--total_steps={config.total_steps}: the run ends at a learning rate of "
                 f"{float(schedule(config.total_steps)):.3g} (end_lr={c.end_lr:g})")
