"""Convert a Hugging Face LLaMA checkpoint directory into an easylm parameters checkpoint.

    python -m easylm.llama.convert_hf_to_easylm --hf_model=DIR --output_dir=DIR [--dtype=keep|bf16|fp32]

The result loads with `--load_checkpoint=params::DIR` in the trainer and the
server. Tensors are read one at a time (safetensors, or `.bin` through
`torch.load(weights_only=True, mmap=True)`), so peak memory stays near the size
of the output. The HF config (GQA, tied embeddings, rope_theta, Llama-3 rope
scaling, rms_norm_eps, vocabulary) becomes the checkpoint's `llama_config`
metadata.
"""

import os
import sys

import jax
from ml_collections import ConfigDict

from easylm import flags
from easylm.checkpoint import save_params
from easylm.errors import UserError, exit_on_user_error
from easylm.hf_checkpoint import HFTensors, read_config
from easylm.llama.config import LLaMAConfig
from easylm.llama.hf_weights import from_hf

DTYPES = {"keep": None, "bf16": "bfloat16", "fp32": "float32"}

HELP = {
    "hf_model": "Hugging Face model directory (config.json + *.safetensors or pytorch_model*.bin)",
    "output_dir": "where to write the easylm parameters checkpoint (must not exist)",
    "dtype": "parameter dtype of the output: keep, bf16 or fp32",
}
USAGE = "usage: python -m easylm.llama.convert_hf_to_easylm --hf_model=DIR --output_dir=DIR"


def get_default_config() -> ConfigDict:
    return ConfigDict(dict(hf_model="", output_dir="", dtype="keep"))


# config.json fields this model reads, by the JSON type they must have (None allowed
# for the optional ones). A wrong type is refused by name, never converted.
_REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_NUMBERS = ("rms_norm_eps", "rope_theta", "initializer_range")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def read_hf_config(directory: str) -> LLaMAConfig:
    """DIR/config.json as a LLaMAConfig; anything this model would compute differently
    from HF's LlamaForCausalLM is a UserError that names the field."""
    hf = read_config(directory)
    path = os.path.join(directory, "config.json")
    architectures = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" or "LlamaForCausalLM" not in architectures:
        raise UserError(
            f"{directory}: model_type {hf.get('model_type')!r} / architectures {architectures} "
            f"is not a LLaMA causal LM (expected model_type 'llama', LlamaForCausalLM)"
        )
    _check_types(hf, path)
    for rope in (hf, hf.get("rope_scaling") or {}, hf.get("rope_parameters") or {}):
        factor = rope.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise UserError(f"{path}: partial_rotary_factor={factor!r} (rotary embeddings on "
                            f"part of each head) is not supported by this LLaMA implementation")
    try:
        return LLaMAConfig.from_hf_config(hf)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:  # e.g. a llama3 rope without its factor
        raise UserError(f"{path}: cannot read its rope settings ({type(e).__name__}: {e})") from None


def _check_types(hf: dict, path: str):
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    is_number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    for name in _REQUIRED_INTS:
        if name not in hf:
            raise UserError(f"{path}: no {name!r}, which a LLaMA config needs")
    checks = [(name, is_int, "an integer") for name in _REQUIRED_INTS + _OPTIONAL_INTS]
    checks += [(name, is_number, "a number") for name in _OPTIONAL_NUMBERS]
    checks += [(name, lambda v: is_int(v) or (isinstance(v, list) and v and all(map(is_int, v))),
                "a token id or a list of them") for name in _TOKEN_IDS]
    checks += [("tie_word_embeddings", lambda v: isinstance(v, bool), "true or false")]
    checks += [(name, lambda v: isinstance(v, dict), "an object")
               for name in ("rope_scaling", "rope_parameters")]
    for name, ok, expected in checks:
        if hf.get(name) is not None and not ok(hf[name]):
            raise UserError(f"{path}: {name} must be {expected}, got {hf[name]!r}")


def load_hf_params(directory: str, dtype: str = "keep", scan_layers: bool = False, place=None):
    """(config, params) from a HF directory; used by `hf::DIR` load specs too.

    Params are numpy arrays, or whatever `place` makes of each (e.g. jax.device_put)."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    config = read_hf_config(directory).replace(scan_layers=scan_layers)
    params = from_hf(HFTensors(directory), config, dtype=DTYPES[dtype], source=directory, place=place)
    return config, params


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
