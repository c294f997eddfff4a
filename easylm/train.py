"""`python -m easylm.train [--family=NAME] [flags]`: `python -m easylm.<family>.train` for
the family of the checkpoint it loads (`hf::DIR`'s config.json model_type, or an easylm
checkpoint's metadata), or the one `--family` names (default: llama). The flags are that
command's: `python -m easylm.train --family=NAME --help` lists them."""

import sys

from easylm.errors import exit_on_user_error
from easylm.models import registry
from easylm.training import trainer


@exit_on_user_error
def main(argv=None):
    family, argv = registry.from_argv(argv or sys.argv, detect=True)
    trainer.main(family, argv)


if __name__ == "__main__":
    main()
