"""The trainer's `--eval_harness.*` flags: lm-eval tasks on the live parameters every N steps.

Only the flags' defaults and help, so that the trainer builds its flag tree without
importing lm-eval (an optional extra, and most of a second to import); the hook itself is
`easylm.evaluation.harness.HarnessHook`. docs/evaluation.md ("Evaluate during training").
"""

from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder

HELP = {
    "tasks": "comma-separated lm-eval task, group or tag names (or task YAML paths) evaluated "
             "on the live parameters during training; empty: off",
    "freq": "evaluate the tasks every this many steps",
    "limit": "documents per task: a count, or a fraction below 1; empty: all",
    "num_fewshot": "few-shot examples per request; empty: each task's own",
    "include_path": "comma-separated directories of extra task YAML files (local tasks)",
    "bootstrap_iters": "bootstrap resamples for the standard errors (logged as "
                       "<metric>_stderr); 0: none",
    "max_gen_toks": "most tokens a generate_until request produces when its task does not say",
    "batch_size": "rows per scoring call, and decode slots for generate_until requests",
    "seq_length": "context of a request; 0: as python -m easylm.llama.eval, the model's "
                  "max_position_embeddings, at most 2048",
    "min_bucket": "shortest prompt-length bucket; buckets double up to seq_length (each "
                  "compiles once, at the first evaluation)",
    "decode_steps": "tokens decoded per device call in generate_until requests",
}


def get_default_config(updates=None) -> ConfigDict:
    config = ConfigDict()
    config.tasks = ""
    config.freq = 1000
    config.limit = placeholder(float)
    config.num_fewshot = placeholder(int)
    config.include_path = ""
    config.bootstrap_iters = 0  # lm-eval's 100,000 take longer than small tasks themselves
    config.max_gen_toks = 256
    config.batch_size = 8
    config.seq_length = 0
    config.min_bucket = 16
    config.decode_steps = 8
    if updates is not None:
        config.update(ConfigDict(updates).copy_and_resolve_references())
    return config


def task_names(config: ConfigDict) -> list[str]:
    """The tasks `--eval_harness.tasks` names; none: the hook is off."""
    return [name.strip() for name in config.tasks.split(",") if name.strip()]
