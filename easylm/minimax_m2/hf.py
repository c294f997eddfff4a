"""The mapping between easylm MiniMax-M2 parameters and the tensors transformers'
`MiniMaxM2ForCausalLM` saves (Mixtral's layout, as the released files have it): our paths
are HF's names with '/' for '.' (`hf_checkpoint.hf_key`), except the MoE's

    mlp/router/kernel (D, E)              <->  block_sparse_moe.gate.weight (E, D)
    mlp/e_score_correction_bias (E,)      <->  block_sparse_moe.e_score_correction_bias
    mlp/experts/{gate,up,down}_proj       <->  block_sparse_moe.experts.<e>.{w1,w3,w2}.weight
"""

import functools

from easylm.minimax_m2.config import MiniMaxM2Config
from easylm.minimax_m2.model import MiniMaxM2ForCausalLM
from easylm.models import sigmoid_moe_hf
from easylm.models.hf_checkpoint import hf_key

_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def hf_names(path: str, shape) -> list[tuple[str, bool]]:
    """Our path -> [(HF tensor name, transpose)]: one per expert for the experts."""
    *module, leaf = path.split("/")
    if module[-1:] == ["mlp"] and leaf == "e_score_correction_bias":
        return [(".".join(module[:-1] + ["block_sparse_moe", leaf]), False)]
    if module[-2:-1] == ["mlp"]:
        block = module[:-2] + ["block_sparse_moe"]
        if module[-1] == "router":
            return [(".".join(block + ["gate", "weight"]), True)]
        return [(".".join(block + ["experts", str(e), _EXPERT[leaf], "weight"]), True)
                for e in range(shape[0])]
    return [hf_key(path)]


to_hf = functools.partial(sigmoid_moe_hf.to_hf, lm=MiniMaxM2ForCausalLM, names=hf_names)


load_hf_params = functools.partial(sigmoid_moe_hf.load_hf_params, config_class=MiniMaxM2Config,
                                   lm=MiniMaxM2ForCausalLM, names=hf_names)
