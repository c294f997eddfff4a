"""Serve a Gemma 3 model over HTTP: `python -m easylm.gemma.serve [--flag=value ...]`.

    python -m easylm.gemma.serve --load_checkpoint=hf::DIR --tokenizer=DIR

The model shape comes from the checkpoint (its metadata, or config.json for `hf::`);
`--gemma.*` flags override fields. The chat template and BOS are the tokenizer's. The
API and the chat page are described in docs/serving.md; the setup is
easylm/serving/cli.py.
"""

from easylm.gemma.family import FAMILY
from easylm.serving import cli


def main(argv=None):
    cli.main(FAMILY, argv)


if __name__ == "__main__":
    main()
