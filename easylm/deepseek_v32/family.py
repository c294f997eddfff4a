"""The DeepSeek-V3.2 family (DeepSeek-V3.2-Exp, DeepSeek-V3.2): `FAMILY`. DeepSeek-V3
(easylm/deepseek_v3) with DeepSeek sparse attention (easylm/models/sparse_attention.py);
its checkpoints are DeepSeek-V3's names (easylm/models/sigmoid_moe_hf.py) and the
indexer's (`self_attn.indexer.wq_b`, `wk`, `k_norm`, `weights_proj`)."""

import functools

from easylm.deepseek_v3.model import PARTITION_RULES as DEEPSEEK_V3_RULES
from easylm.deepseek_v32.config import DEEPSEEK_V32_PRESETS, DeepseekV32Config
from easylm.models import sigmoid_moe_hf, sparse_attention
from easylm.models.family import HFAdapter, ModelFamily, hf_params_reader
from easylm.models.sparse_attention import SparseMLACausalLM

PARTITION_RULES = sparse_attention.PARTITION_RULES + DEEPSEEK_V3_RULES


class DeepseekV32ForCausalLM(SparseMLACausalLM):
    pass


load_hf_params = functools.partial(sigmoid_moe_hf.load_hf_params,
                                   config_class=DeepseekV32Config, lm=DeepseekV32ForCausalLM)


class DeepseekV32Family(ModelFamily):
    name = "deepseek_v32"
    config_class = DeepseekV32Config
    presets = DEEPSEEK_V32_PRESETS
    default_preset = "debug"
    tiny_preset = "debug"
    module_class = DeepseekV32ForCausalLM
    variants = ("lora", "int8")
    hf = HFAdapter(model_types=("deepseek_v32",), read_config=DeepseekV32Config.read_hf,
                   write_params=functools.partial(sigmoid_moe_hf.to_hf,
                                                  lm=DeepseekV32ForCausalLM),
                   read_params=hf_params_reader(load_hf_params, DeepseekV32ForCausalLM))

    def partition_rules(self, config: DeepseekV32Config):
        return PARTITION_RULES


FAMILY = DeepseekV32Family()
