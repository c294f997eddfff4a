"""Convert a Hugging Face Gemma 3 directory (`gemma3_text`, or the text tower of a
multimodal `gemma3`) into an easylm parameters checkpoint.

    python -m easylm.gemma.convert_hf_to_easylm --hf_model=DIR --output_dir=DIR \
        [--dtype=keep|bf16|fp32]

The result loads with `--load_checkpoint=params::DIR` in the trainer and the server;
config.json becomes the checkpoint's `gemma_config` metadata. Tensors are read one at a
time, so peak memory stays near the size of the output.
"""

import sys

import jax
from ml_collections import ConfigDict

from easylm import flags
from easylm.errors import UserError, exit_on_user_error
from easylm.gemma.family import FAMILY
from easylm.gemma.hf import load_hf_params
from easylm.runtime.checkpoint import save_params

HELP = {
    "hf_model": "Hugging Face model directory (config.json + *.safetensors or pytorch_model*.bin)",
    "output_dir": "where to write the easylm parameters checkpoint (must not exist)",
    "dtype": "parameter dtype of the output: keep, bf16 or fp32",
}
USAGE = "usage: python -m easylm.gemma.convert_hf_to_easylm --hf_model=DIR --output_dir=DIR"


@exit_on_user_error
def main(argv=None):
    FLAGS = flags.parse(ConfigDict(dict(hf_model="", output_dir="", dtype="keep")), HELP,
                        list(argv or sys.argv), USAGE)
    if not FLAGS.hf_model or not FLAGS.output_dir:
        raise UserError("both --hf_model and --output_dir are required")
    # Each tensor becomes a jax array as it is read: orbax saves them without a second
    # host copy of the model.
    config, params = load_hf_params(FLAGS.hf_model, FLAGS.dtype, place=jax.device_put)
    metadata = {"model": FAMILY.name, FAMILY.metadata_key: config.to_dict(),
                "source": FLAGS.hf_model}
    directory = save_params(FLAGS.output_dir, params, metadata)
    print(f"wrote {config.num_parameters():,} parameters to {directory}")
    print(f"load it with --load_checkpoint=params::{directory}")


if __name__ == "__main__":
    main()
