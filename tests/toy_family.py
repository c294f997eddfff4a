"""A second model family, for tests only: what a new family writes on the kit
(docs/families.md), and proof that the family boundary is real.

A parallel-residual decoder (GPT-J's and Falcon's layer: attention and MLP read the same
norm of x and are added together), a GELU-gated MLP, untied head. It is a config, a layer
and a partition-rule table; the decoder around the layer, the losses, the cache, LoRA and
int8 come from easylm/models/. Nothing outside this file knows it.

Shape letters: B batch, T positions, D width.
"""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from easylm.models.config import ModelConfig, default, field
from easylm.models.decoder import Attention, CausalLM, GatedMLP, Sublayer
from easylm.models.family import ModelFamily


@dataclasses.dataclass(frozen=True)
class ToyConfig(ModelConfig):
    vocab_size: int = default(512)
    hidden_size: int = default(32)
    intermediate_size: int = default(128)
    num_hidden_layers: int = default(2)
    num_attention_heads: int = default(2)
    max_position_embeddings: int = default(64)
    attention: str = default("xla")
    mlp_activation: str = field("gelu", "the MLP's gate activation: gelu or silu")

    def num_matmul_parameters(self) -> int:
        d, f = self.hidden_size, self.intermediate_size
        return self.num_hidden_layers * (4 * d * d + 3 * d * f) + d * self.vocab_size

    def num_parameters(self) -> int:
        return self.num_matmul_parameters() + self.vocab_size * self.hidden_size + \
            (self.num_hidden_layers + 1) * self.hidden_size

    def flops_per_token(self, seq_length: int) -> float:
        return 6 * self.num_matmul_parameters() + \
            6 * self.num_hidden_layers * self.hidden_size * seq_length


class ParallelLayer(Sublayer):
    kind: str = "full_attention"

    @nn.compact
    def __call__(self, x, context, positions=None, cache=None):
        h = self.norm("norm")(x)
        attended, cache = Attention(self.config, self.dtype, self.param_dtype, name="attn")(
            h, *context, positions, cache)  # cos, sin, mask, window
        activation = {"gelu": nn.gelu, "silu": nn.silu}[self.config.mlp_activation]
        mlp = GatedMLP(self.config, self.dtype, self.param_dtype, activation=activation,
                       name="mlp")(h)
        return x + attended + mlp, cache


class ToyLM(CausalLM):
    layer = ParallelLayer

    @classmethod
    def inv_freq(cls, config: ToyConfig, kind: str):
        return 1.0 / (10_000 ** (jnp.arange(0, config.head_dim, 2, dtype=jnp.float32)
                                 / config.head_dim))


class ToyFamily(ModelFamily):
    name = "toy"
    config_class = ToyConfig
    presets = {"tiny": {}, "wide": {"hidden_size": 64}}
    default_preset = "tiny"
    module_class = ToyLM

    def partition_rules(self, config: ToyConfig):
        return ((r"embed_tokens/embedding", P(None, "fsdp")),
                (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel", P("fsdp", "mp")),
                (r"(o_proj|down_proj)/kernel", P("mp", "fsdp")),
                (r"lm_head/kernel", P("fsdp", None)),
                (r"norm/weight", P(None)))


FAMILY = ToyFamily()
