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

from easylm.models.decoder import Attention, CausalLM, GatedMLP, Sublayer
from easylm.models.family import ModelFamily


def _field(default, text):
    return dataclasses.field(default=default, metadata={"help": text})


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = _field(512, "tokens")
    width: int = _field(32, "model width D")
    num_layers: int = _field(2, "layers")
    # What the decoder reads, fixed here.
    num_attention_heads, num_key_value_heads, head_dim = 2, 2, 16
    initializer_range, rms_norm_eps, tie_word_embeddings = 0.02, 1e-6, False
    remat_policy, attention, loss_chunk_size = "none", "xla", 0
    max_length: int = _field(64, "longest row")
    eos_token_id: int = _field(2, "end of sequence")
    scan_layers: bool = _field(False, "one scanned layer")

    hidden_size = property(lambda self: self.width)
    intermediate_size = property(lambda self: 4 * self.width)
    num_hidden_layers = property(lambda self: self.num_layers)
    max_position_embeddings = property(lambda self: self.max_length)

    def num_matmul_parameters(self) -> int:
        d = self.width
        return self.num_layers * (4 * d * d + 3 * d * 4 * d) + d * self.vocab_size

    def num_parameters(self) -> int:
        return self.num_matmul_parameters() + self.vocab_size * self.width + \
            (self.num_layers + 1) * self.width

    def flops_per_token(self, seq_length: int) -> float:
        return 6 * self.num_matmul_parameters() + 6 * self.num_layers * self.width * seq_length

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "ToyConfig":
        return dataclasses.replace(self, **changes)


class ParallelLayer(Sublayer):
    kind: str = "full_attention"

    @nn.compact
    def __call__(self, x, context, positions=None, cache=None):
        h = self.norm("norm")(x)
        attended, cache = Attention(self.config, self.dtype, self.param_dtype, name="attn")(
            h, *context, 0, positions, cache)
        mlp = GatedMLP(self.config, self.dtype, self.param_dtype, activation=nn.gelu,
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
    presets = {"tiny": {}, "wide": {"width": 64}}
    default_preset = "tiny"
    commands = "toy_family"  # no `python -m toy_family.serve`: the trainer's hint names it only
    module_class = ToyLM

    def partition_rules(self, config: ToyConfig):
        return ((r"embed_tokens/embedding", P(None, "fsdp")),
                (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel", P("fsdp", "mp")),
                (r"(o_proj|down_proj)/kernel", P("mp", "fsdp")),
                (r"lm_head/kernel", P("fsdp", None)),
                (r"norm/weight", P(None)))

    def shard_variant(self, config: ToyConfig, layers: int, mp: int) -> ToyConfig:
        return config.replace(num_layers=layers, vocab_size=-(-config.vocab_size // mp))


FAMILY = ToyFamily()
