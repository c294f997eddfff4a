"""Evaluate a Gemma 3 checkpoint with lm-evaluation-harness: `python -m easylm.gemma.eval`.

    python -m easylm.gemma.eval --load_checkpoint=hf::DIR --tokenizer=DIR \\
        --tasks=hellaswag --limit=200 --batch_size=32

The command is easylm/evaluation/cli.py's (docs/evaluation.md); the model loads as
`easylm.gemma.serve` loads it.
"""

from easylm.evaluation import cli
from easylm.gemma.family import FAMILY


def main(argv=None):
    cli.main(FAMILY, argv)


if __name__ == "__main__":
    main()
