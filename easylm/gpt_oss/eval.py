"""Evaluate a gpt-oss checkpoint with lm-evaluation-harness: `python -m easylm.gpt_oss.eval`.

    python -m easylm.gpt_oss.eval --load_checkpoint=hf::DIR --tokenizer=DIR --tasks=hellaswag

The command is easylm/evaluation/cli.py's (docs/evaluation.md).
"""

from easylm.evaluation import cli
from easylm.gpt_oss.family import FAMILY


def main(argv=None):
    cli.main(FAMILY, argv)


if __name__ == "__main__":
    main()
