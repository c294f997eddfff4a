"""Train a gpt-oss model: `python -m easylm.gpt_oss.train [--flag=value ...]`.

    python -m easylm.gpt_oss.train --load_checkpoint=hf::DIR --tokenizer=DIR \\
        --train_dataset.json_dataset.path=data.jsonl

Fine-tunes a Hugging Face gpt-oss directory (MXFP4 experts dequantized on load), or
trains a --gpt_oss.base_model preset from scratch. The trainer is easylm/training's, the
flags those of `python -m easylm.llama.train` with --gpt_oss.* for the model.
"""

from easylm.gpt_oss.family import FAMILY
from easylm.training import trainer


def main(argv=None):
    trainer.main(FAMILY, argv)


if __name__ == "__main__":
    main()
