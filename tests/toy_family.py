"""A second model family, for tests only: proof that the family boundary is real.

A 2-layer, single-head causal LM with learned absolute position embeddings, LayerNorm,
a GELU MLP and a parameter tree unlike LLaMA's (`tokens`, `positions`, `block<i>/...`,
`head`). Everything the generic code needs is here; nothing outside this file knows it.

Shape letters: B batch, T positions, S cache positions, D width, V vocabulary.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from easylm.models.family import Model, ModelFamily
from easylm.runtime.sharding import BATCH_AXES


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = dataclasses.field(default=512, metadata={"help": "tokens"})
    width: int = dataclasses.field(default=32, metadata={"help": "model width D"})
    num_layers: int = dataclasses.field(default=2, metadata={"help": "blocks"})
    max_length: int = dataclasses.field(default=64, metadata={"help": "learned positions"})
    eos_token_id: int = dataclasses.field(default=2, metadata={"help": "end of sequence"})

    def num_parameters(self) -> int:
        d, v = self.width, self.vocab_size
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
        return v * d + self.max_length * d + self.num_layers * block + 2 * d + d * v + v


class ToyLM(nn.Module):
    config: ToyConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, ids, positions=None, cache=None):
        c, B, T = self.config, *ids.shape
        dense = lambda n, name: nn.Dense(n, dtype=self.dtype, param_dtype=self.param_dtype,  # noqa: E731
                                         name=name)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        x = (nn.Embed(c.vocab_size, c.width, param_dtype=self.param_dtype, name="tokens")(ids)
             + nn.Embed(c.max_length, c.width, param_dtype=self.param_dtype,
                        name="positions")(positions)).astype(self.dtype)  # (B, T, D)
        new_cache = {}
        for i in range(c.num_layers):
            h = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name=f"block{i}_ln1")(x)
            q, k, v = jnp.split(dense(3 * c.width, f"block{i}_qkv")(h), 3, axis=-1)  # (B, T, D)
            key_positions = positions
            if cache is not None:  # the cache's keys/values: (B, S, 1, D), one head
                rows = jnp.arange(B)[:, None]
                keys = cache[f"block{i}"]["k"].at[rows, positions, 0].set(k.astype(self.dtype))
                values = cache[f"block{i}"]["v"].at[rows, positions, 0].set(v.astype(self.dtype))
                new_cache[f"block{i}"] = {"k": keys, "v": values}
                k, v = keys[:, :, 0], values[:, :, 0]
                key_positions = jnp.broadcast_to(jnp.arange(k.shape[1]), (B, k.shape[1]))
            scores = jnp.einsum("BTD,BSD->BTS", q, k) / jnp.sqrt(c.width).astype(self.dtype)
            causal = key_positions[:, None, :] <= positions[:, :, None]
            weights = jax.nn.softmax(jnp.where(causal, scores, -1e9).astype(jnp.float32), axis=-1)
            x = x + dense(c.width, f"block{i}_out")(
                jnp.einsum("BTS,BSD->BTD", weights.astype(self.dtype), v))
            h = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name=f"block{i}_ln2")(x)
            x = x + dense(c.width, f"block{i}_down")(nn.gelu(dense(4 * c.width, f"block{i}_up")(h)))
        h = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="final_ln")(x)
        logits = dense(c.vocab_size, "head")(h).astype(jnp.float32)  # (B, T, V)
        return logits if cache is None else (logits, new_cache)

    def init_cache(self, batch: int, length: int):
        zeros = lambda: jnp.zeros((batch, length, 1, self.config.width), self.dtype)  # noqa: E731
        return {f"block{i}": {"k": zeros(), "v": zeros()} for i in range(self.config.num_layers)}


RULES = (
    (r"(tokens|positions)/embedding", P(None, "fsdp")),
    (r"kernel", P("fsdp", None)),
    (r"(bias|scale)", P(None)),
)


class ToyFamily(ModelFamily):
    name = "toy"
    config_class = ToyConfig
    presets = {"tiny": {}, "wide": {"width": 64}}
    default_preset = "tiny"
    commands = "toy_family"  # no `python -m toy_family.serve`: the trainer's hint names it only

    def bind(self, config: ToyConfig, dtype=jnp.float32, param_dtype=jnp.float32) -> Model:
        module = ToyLM(config, dtype, param_dtype)

        def forward(params, ids, positions=None, segment_ids=None, cache=None, *, base=None,
                    rng=None, return_hidden=False):
            assert segment_ids is None and not return_hidden  # no packing, no chunked loss
            return module.apply({"params": params}, ids, positions, cache)

        return Model(
            name=self.name, config=dataclasses.asdict(config), vocab_size=config.vocab_size,
            init_params=lambda rng: module.init(rng, jnp.zeros((1, 8), jnp.int32))["params"],
            forward=forward, partition_rules=RULES,
            flops_per_token=lambda T: 6 * config.num_parameters() + 6 * config.num_layers * config.width * T,
            init_cache=module.init_cache,
            cache_rules=((r"(k|v)$", P(BATCH_AXES, None, None, None)),),
            max_seq_length=config.max_length, eos_token_id=config.eos_token_id,
            num_layers=config.num_layers, num_parameters=config.num_parameters())

    def shard_variant(self, config: ToyConfig, layers: int, mp: int) -> ToyConfig:
        return dataclasses.replace(config, num_layers=layers,
                                   vocab_size=-(-config.vocab_size // mp))


FAMILY = ToyFamily()
