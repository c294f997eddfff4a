"""The mapping between easylm Llama 4 parameters and transformers' Llama4ForCausalLM
tensors: our paths are HF's names with '/' for '.' (kernels transposed), except the
experts, which transformers 5 saves fused with the input axis first:

    feed_forward/experts/gate_proj, up_proj (E, D, F)  <->  feed_forward.experts.gate_up_proj
                                                            (E, D, 2F), gate's columns first
    feed_forward/experts/down_proj (E, F, D)           <->  feed_forward.experts.down_proj
                                                            (E, F, D)
"""

import functools

from easylm.errors import UserError
from easylm.llama4.config import Llama4Config
from easylm.llama4.model import Llama4ForCausalLM
from easylm.models import sigmoid_moe_hf
from easylm.models.hf_checkpoint import HFTensors, PerExpertTensors, fuse_experts, hf_key


def hf_names(path: str, shape) -> list[tuple[str, bool]]:
    *module, leaf = path.split("/")
    if module[-1:] == ["experts"]:
        return [(".".join(module + [str(e), leaf, "weight"]), True) for e in range(shape[0])]
    return [hf_key(path)]


def to_hf(params, config: Llama4Config):
    return fuse_experts(sigmoid_moe_hf.to_hf(params, config, lm=Llama4ForCausalLM,
                                             names=hf_names), in_out=True)


from_hf = functools.partial(sigmoid_moe_hf.from_hf, lm=Llama4ForCausalLM, names=hf_names)


def load_hf_params(directory: str, dtype: str = "keep", place=None):
    if dtype not in sigmoid_moe_hf.DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(sigmoid_moe_hf.DTYPES)}")
    config = Llama4Config.read_hf(directory)
    tensors = PerExpertTensors(HFTensors(directory), in_out=True)
    return config, from_hf(tensors, config, dtype=sigmoid_moe_hf.DTYPES[dtype],
                           source=directory, place=place)
