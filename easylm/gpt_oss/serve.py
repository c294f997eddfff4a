"""Serve a gpt-oss model over HTTP: `python -m easylm.gpt_oss.serve [--flag=value ...]`.

    python -m easylm.gpt_oss.serve --load_checkpoint=hf::DIR --tokenizer=DIR

The model shape comes from the checkpoint (its metadata, or config.json for `hf::`);
`--gpt_oss.*` flags override fields. The API is described in docs/serving.md; the setup
is easylm/serving/cli.py.
"""

from easylm.gpt_oss.family import FAMILY
from easylm.serving import cli


def main(argv=None):
    cli.main(FAMILY, argv)


if __name__ == "__main__":
    main()
