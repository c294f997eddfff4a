"""Serve a LLaMA model over HTTP: `python -m easylm.llama.serve [--flag=value ...]`.

    python -m easylm.llama.serve --load_checkpoint=params::DIR --tokenizer=embedded
    python -m easylm.llama.serve --load_checkpoint=hf::DIR --tokenizer=DIR --mesh_dim=1,1,-1

The model shape comes from the checkpoint (its metadata, or config.json for
`hf::`); `--llama.*` flags override fields. All flags: `--help`. The API and the
chat page are described in docs/serving.md; the setup is easylm/serving/cli.py.
"""

from easylm.llama.family import FAMILY
from easylm.serving import cli


def main(argv=None):
    cli.main(FAMILY, argv)


if __name__ == "__main__":
    main()
