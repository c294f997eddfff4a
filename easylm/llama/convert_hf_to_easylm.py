"""Convert a Hugging Face LLaMA checkpoint directory (or a Qwen2/2.5, Qwen3 or Mistral one,
the LLaMA variants) into an easylm parameters checkpoint.

    python -m easylm.llama.convert_hf_to_easylm --hf_model=DIR --output_dir=DIR [--dtype=keep|bf16|fp32]

The result loads with `--load_checkpoint=params::DIR` in the trainer and the
server. Tensors are read one at a time (safetensors, or `.bin` through
`torch.load(weights_only=True, mmap=True)`), so peak memory stays near the size
of the output. The HF config (GQA, tied embeddings, rope_theta, Llama-3 rope
scaling, rms_norm_eps, vocabulary, the variant and its biases, q/k norms and sliding
window) becomes the checkpoint's `llama_config` metadata.
"""

import sys

import jax
from ml_collections import ConfigDict

from easylm import flags
from easylm.errors import UserError, exit_on_user_error
from easylm.llama.config import LLaMAConfig
from easylm.llama.hf import load_hf_params
from easylm.runtime.checkpoint import save_params

HELP = {
    "hf_model": "Hugging Face model directory (config.json + *.safetensors or pytorch_model*.bin)",
    "output_dir": "where to write the easylm parameters checkpoint (must not exist)",
    "dtype": "parameter dtype of the output: keep, bf16 or fp32",
}
USAGE = "usage: python -m easylm.llama.convert_hf_to_easylm --hf_model=DIR --output_dir=DIR"


def get_default_config() -> ConfigDict:
    return ConfigDict(dict(hf_model="", output_dir="", dtype="keep"))


def metadata_for(config: LLaMAConfig, source: str) -> dict:
    return {"model": "llama", "llama_config": config.to_dict(), "source": source}


@exit_on_user_error
def main(argv=None):
    argv = list(argv or sys.argv)
    FLAGS = flags.parse(get_default_config(), HELP, argv, USAGE)
    if not FLAGS.hf_model or not FLAGS.output_dir:
        raise UserError("both --hf_model and --output_dir are required")
    # Each tensor becomes a jax array as it is read: orbax saves jax arrays without
    # a second host copy of the whole model, which numpy inputs would cost.
    config, params = load_hf_params(FLAGS.hf_model, FLAGS.dtype, place=jax.device_put)
    directory = save_params(FLAGS.output_dir, params, metadata_for(config, FLAGS.hf_model))
    print(f"wrote {config.num_parameters():,} parameters to {directory}")
    print(f"load it with --load_checkpoint=params::{directory}")


if __name__ == "__main__":
    main()
