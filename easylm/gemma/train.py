"""Train a Gemma 3 model: `python -m easylm.gemma.train [--flag=value ...]`.

    python -m easylm.gemma.train --load_checkpoint=hf::DIR --tokenizer=DIR \\
        --train_dataset.json_dataset.path=data.jsonl

Fine-tunes a Hugging Face Gemma 3 directory (`gemma3_text`, or a `gemma3`'s text tower),
or trains a --gemma.base_model preset from scratch. The trainer is easylm/training's, the
flags those of `python -m easylm.llama.train` with --gemma.* for the model; all:
`python -m easylm.gemma.train --help`.
"""

from easylm.gemma.family import FAMILY
from easylm.training import trainer


def main(argv=None):
    trainer.main(FAMILY, argv)


if __name__ == "__main__":
    main()
