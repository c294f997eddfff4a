"""Train a LLaMA model: `python -m easylm.llama.train [--flag=value ...]`.

With no flags it trains a small LLaMA on the corpus and tokenizer embedded in
the package, on CPU in a few minutes, and prints how to serve the result: the
embedded demo, whose settings (`EMBEDDED_DEFAULTS` in easylm/llama/family.py: 200
steps at a peak learning rate of 3e-3, rows of 256 tokens, 16 a batch) apply only
to a run given no data and no checkpoint. Every other run starts from the usual
defaults (10,000 steps, AdamW peaking at 3e-4, rows of 1024 tokens, 8 a batch;
2e-5 when fine-tuning a pretrained checkpoint), the schedule always ending with
the run. All flags: `python -m easylm.llama.train --help`; examples in `configs/`.
"""

from easylm.llama.family import FAMILY
from easylm.training import options, trainer


def default_config():
    return options.default_config(FAMILY)


def help_entries() -> dict:
    return options.help_entries(FAMILY)


def parse_flags(argv: list[str]):
    return options.parse_flags(FAMILY, argv)


def main(argv=None):
    trainer.main(FAMILY, argv)


if __name__ == "__main__":
    main()
