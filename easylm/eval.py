"""`python -m easylm.eval [--family=NAME] [flags]`: `python -m easylm.<family>.eval` for
the family of the checkpoint it loads (`hf::DIR`'s config.json model_type, or an easylm
checkpoint's metadata), or the one `--family` names (default: llama). The flags are that
command's: `python -m easylm.eval --family=NAME --help` lists them."""

import importlib
import sys

from easylm.errors import exit_on_user_error
from easylm.models import registry


@exit_on_user_error
def main(argv=None):
    family, argv = registry.from_argv(argv or sys.argv, detect=True)
    importlib.import_module(f"{family.commands}.eval").main(argv)


if __name__ == "__main__":
    main()
