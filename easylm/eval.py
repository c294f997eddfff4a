"""`python -m easylm.eval [--family=NAME] [flags]`: evaluate a checkpoint of any family with
lm-evaluation-harness (easylm/evaluation/cli.py), the family that of the checkpoint it
loads (`hf::DIR`'s config.json model_type, or an easylm checkpoint's metadata), or the one
`--family` names (default: llama). `python -m easylm.eval --family=NAME --help` lists the
flags."""

import sys

from easylm.errors import exit_on_user_error
from easylm.evaluation import cli
from easylm.models import registry


@exit_on_user_error
def main(argv=None):
    family, argv = registry.from_argv(argv or sys.argv, detect=True)
    cli.main(family, argv)


if __name__ == "__main__":
    main()
