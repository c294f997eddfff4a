"""Evaluate a LLaMA checkpoint with lm-evaluation-harness, in-process: `python -m easylm.llama.eval`.

    python -m easylm.llama.eval --load_checkpoint=hf::DIR --tokenizer=DIR \\
        --tasks=hellaswag,lambada_openai --limit=200 --batch_size=32
    python -m easylm.llama.eval --load_checkpoint=params::runs/RUN/checkpoints/1000 \\
        --tokenizer=embedded --tasks=my_task --include_path=my_tasks/

Prints lm-eval's table and writes its results as JSON (and with --log_samples every
request and response) to --output_dir, by default CHECKPOINT-eval/ beside the
checkpoint. The model loads as `easylm.llama.serve` loads it; its engine flags
(--batch_size, --seq_length, ...) are the server's. lm-eval's `--model easylm` is
`easylm.llama.lm_eval_model`. See docs/evaluation.md; the command is
easylm/evaluation/cli.py's.
"""

from ml_collections import ConfigDict

from easylm.evaluation import cli
from easylm.llama.family import FAMILY

HELP = cli.HELP
output_directory = cli.output_directory


def model_config() -> ConfigDict:
    return cli.model_config(FAMILY)


def default_config() -> ConfigDict:
    return cli.default_config(FAMILY)


def help_entries() -> dict:
    return cli.help_entries(FAMILY)


def load(config: ConfigDict, cls=None):
    """The model of `config` (`model_config()` flags) as an lm-eval model, a `HarnessLM`
    (or `cls`, a subclass)."""
    return cli.load(FAMILY, config, cls)


def main(argv=None):
    cli.main(FAMILY, argv)


if __name__ == "__main__":
    main()
