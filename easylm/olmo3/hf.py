"""The mapping between easylm OLMo 3 parameters and transformers' `Olmo3ForCausalLM`
tensors: every path is HF's name with '/' for '.' (`hf_checkpoint.hf_key`), kernels
transposed, so the map is that rule."""

from easylm.errors import UserError
from easylm.models.family import params_by_rule, tensors_by_rule
from easylm.models.hf_checkpoint import HFTensors
from easylm.olmo3.config import Olmo3Config
from easylm.olmo3.model import Olmo3ForCausalLM
from easylm.runtime.dtypes import cast_names

DTYPES = cast_names(("bf16", "fp32"))


def to_hf(params, config: Olmo3Config):
    return tensors_by_rule(Olmo3ForCausalLM, params, config)


def load_hf_params(directory: str, dtype: str = "keep", place=None):
    """(config, params) from a HF directory: numpy arrays, or what `place` makes of each."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    config = Olmo3Config.read_hf(directory)
    return config, params_by_rule(Olmo3ForCausalLM, HFTensors(directory), config,
                                  DTYPES[dtype], directory, place)
