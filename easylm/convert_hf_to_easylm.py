"""Convert a Hugging Face model directory into an easylm parameters checkpoint, for any
model family (the one whose `hf_model_types` has config.json's model_type, or
--family=NAME):

    python -m easylm.convert_hf_to_easylm --hf_model=DIR --output_dir=DIR \\
        [--dtype=keep|bf16|fp32] [--family=NAME]

The result loads with `--load_checkpoint=params::DIR` in the trainer and the server;
config.json becomes the checkpoint's `<family>_config` metadata. Tensors are read one at a
time (safetensors, or `.bin` through `torch.load(weights_only=True, mmap=True)`), so peak
memory stays near the size of the output. `python -m easylm.llama.convert_hf_to_easylm`
and `easylm.gemma.convert_hf_to_easylm` are this command for their family.
"""

import sys

import jax
from ml_collections import ConfigDict

from easylm import flags, model_flags
from easylm.errors import UserError, exit_on_user_error
from easylm.models import registry
from easylm.models.family import ModelFamily, hf_adapter
from easylm.runtime.checkpoint import save_params

HELP = {
    "hf_model": "Hugging Face model directory (config.json + *.safetensors or pytorch_model*.bin)",
    "output_dir": "where to write the easylm parameters checkpoint (must not exist)",
    "dtype": "parameter dtype of the output: keep, bf16 or fp32",
}


def get_default_config() -> ConfigDict:
    return ConfigDict(dict(hf_model="", output_dir="", dtype="keep"))


def metadata_for(family: ModelFamily, config, source: str) -> dict:
    return {"model": family.name, model_flags.metadata_key(family): config.to_dict(),
            "source": source}


def convert(family: ModelFamily, FLAGS) -> None:
    if not FLAGS.hf_model or not FLAGS.output_dir:
        raise UserError("both --hf_model and --output_dir are required")
    config = hf_adapter(family).read_config(FLAGS.hf_model)
    # Each tensor becomes a jax array as it is read: orbax saves jax arrays without a
    # second host copy of the whole model, which numpy inputs would cost.
    params = hf_adapter(family).read_params(FLAGS.hf_model, config, FLAGS.dtype,
                                           place=jax.device_put)
    directory = save_params(FLAGS.output_dir, params,
                            metadata_for(family, config, FLAGS.hf_model))
    print(f"wrote {config.num_parameters():,} parameters to {directory}")
    print(f"load it with --load_checkpoint=params::{directory}")


def family_in(argv: list[str]) -> tuple[ModelFamily, list[str]]:
    """(the family --family=NAME names, else the one that reads --hf_model's config.json,
    else the default; argv without --family)."""
    named = any(arg.startswith("--family=") for arg in argv)
    family, argv = registry.from_argv(argv, detect=True)
    source = next((arg.partition("=")[2] for arg in argv if arg.startswith("--hf_model=")), "")
    if not named and source:
        family = registry.get(registry.family_of(f"hf::{source}") or registry.DEFAULT)
    return family, argv


@exit_on_user_error
def main(argv=None, family: ModelFamily | None = None, command: str = "easylm"):
    """The command; a family's alias (`python -m easylm.<family>.convert_hf_to_easylm`)
    passes its family and its name."""
    argv = list(argv or sys.argv)
    if family is None:
        family, argv = family_in(argv)
    usage = f"usage: python -m {command}.convert_hf_to_easylm --hf_model=DIR --output_dir=DIR"
    convert(family, flags.parse(get_default_config(), HELP, argv, usage))


if __name__ == "__main__":
    main()
