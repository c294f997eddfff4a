"""A decoder whose first `first_k_dense_replace` layers have a dense gated MLP and the
others DeepSeek-V3's mixture of experts (sigmoid_moe.py), as DeepSeek-V3 and GLM-4.5
build theirs: the config fields, checks, parameter counting and config.json reading of
that MoE, and the layer around a family's own attention. A family adds its attention
(its fields, `_attention_params`, `flops_per_token`, the layer's `attend`).
"""

import dataclasses
import sys

import flax.linen as nn
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from easylm.errors import UserError
from easylm.models import rope, sigmoid_moe
from easylm.models.config import ModelConfig, field
from easylm.models.decoder import CausalLM, GatedMLP, RMSNorm, Sublayer
from easylm.models.moe import ExpertMatmulConfig, RouterLoss
from easylm.models.sigmoid_moe import SigmoidMoEConfig
from easylm.runtime.sharding import BATCH_AXES, constrain

# config.json's keys whose other values these layers do not implement.
HF_MUST_BE = {"hidden_act": "silu", "topk_method": "noaux_tc", "scoring_func": "sigmoid"}


@dataclasses.dataclass(frozen=True)
class SigmoidMoEDecoderConfig(ExpertMatmulConfig, ModelConfig):
    """The MoE's fields, DeepSeek-V3's defaults; a family redeclares a default with
    `default(value)` (the help stays this one)."""

    routed_experts_field = "n_routed_experts"
    experts_per_token_field = "num_experts_per_tok"

    moe_intermediate_size: int = field(2048, "one routed (and shared) expert's MLP width")
    n_routed_experts: int = field(256, "routed experts E")
    n_shared_experts: int = field(1, "shared experts every token takes")
    num_experts_per_tok: int = field(8, "routed experts chosen per token K")
    n_group: int = field(8, "expert groups of the group-limited top-k")
    topk_group: int = field(4, "groups kept per token")
    first_k_dense_replace: int = field(3, "the first layers with a dense MLP")
    routed_scaling_factor: float = field(2.5, "multiplies the routed experts' weights")
    norm_topk_prob: bool = field(True, "divide the chosen weights by their sum")
    routed_bias_update_rate: float = field(
        0.0, "aux-loss-free load balancing (MaxText's name): after each optimizer step each "
             "layer's correction bias moves by this times sign(mean load - expert load); 0: "
             "frozen (fine-tuning)")
    aux_loss_alpha: float = field(0.0, "DeepSeek's sequence-wise auxiliary loss weight; only 0 "
                                       "(off) is built")

    def __post_init__(self):
        super().__post_init__()
        self.check_moe()

    def check_moe(self):
        """The MoE fields' checks, each a UserError naming `--<section>.<field>`."""
        family = self.section
        checks = (
            (0 <= self.first_k_dense_replace <= self.num_hidden_layers,
             f"first_k_dense_replace={self.first_k_dense_replace} must be in "
             f"0..num_hidden_layers={self.num_hidden_layers}"),
            (not self.aux_loss_alpha,
             f"aux_loss_alpha={self.aux_loss_alpha}: the sequence-wise auxiliary loss is not "
             f"built; 0 (off) is"),
            (self.routed_bias_update_rate >= 0,
             f"routed_bias_update_rate={self.routed_bias_update_rate} must be >= 0"),
        )
        for ok, message in checks:
            if not ok:
                raise UserError(f"--{family}.{message}")
        try:
            self.moe()
        except ValueError as e:
            raise UserError(f"--{family}: {e}") from None

    def router_loss(self) -> RouterLoss:
        """Nothing trained on (aux 0, as the other mixtures without output_router_logits):
        the routers' statistics logged, the biases moved by them when the rate is set, and
        a model with routers to record and replay (GRPO's routing replay)."""
        return RouterLoss(self.num_experts_per_tok, 0.0,
                          bias_update_rate=self.routed_bias_update_rate)

    def shard_variant(self, layers: int, mp: int):
        # The planner's few layers keep one dense layer first where the model has one: the
        # second of two is then one of experts, the layer it counts L - 1 times.
        # Set before the layers shrink, which would else check 3 dense layers of 1.
        fewer = self.replace(first_k_dense_replace=min(self.first_k_dense_replace, 1))
        return super(SigmoidMoEDecoderConfig, fewer).shard_variant(layers, mp)

    def layer_kinds(self) -> tuple[str, ...]:
        k = self.first_k_dense_replace
        return ("dense",) * k + ("moe",) * (self.num_hidden_layers - k)

    def moe(self) -> SigmoidMoEConfig:
        return SigmoidMoEConfig(self.n_routed_experts, self.num_experts_per_tok,
                                self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                                initializer_range=self.initializer_range, n_group=self.n_group,
                                topk_group=self.topk_group,
                                routed_scaling_factor=self.routed_scaling_factor,
                                n_shared_experts=self.n_shared_experts,
                                matmul=self.moe_matmul)

    def hf_config_kwargs(self) -> dict:
        """transformers' config arguments both families write alike (to_hf_config adds the
        attention's)."""
        return dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            n_shared_experts=self.n_shared_experts, n_routed_experts=self.n_routed_experts,
            routed_scaling_factor=self.routed_scaling_factor, n_group=self.n_group,
            topk_group=self.topk_group, num_experts_per_tok=self.num_experts_per_tok,
            first_k_dense_replace=self.first_k_dense_replace,
            norm_topk_prob=self.norm_topk_prob,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range, rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id)

    # --------------------------------------------------------------- counting

    def _attention_params(self) -> int:
        raise NotImplementedError

    def _mlp_params(self, kind: str, active: bool = False) -> int:
        d = self.hidden_size
        if kind == "dense":
            return 3 * d * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.n_routed_experts
        return (3 * d * self.moe_intermediate_size * (experts + self.n_shared_experts)
                + d * self.n_routed_experts)

    def num_parameters(self) -> int:
        d, v = self.hidden_size, self.vocab_size
        layers = sum(self._attention_params() + self._mlp_params(k) + 2 * d
                     for k in self.layer_kinds())
        return v * d * (1 if self.tie_word_embeddings else 2) + layers + d

    def num_matmul_parameters(self) -> int:
        """Active: the chosen and shared experts only."""
        return (sum(self._attention_params() + self._mlp_params(k, True)
                    for k in self.layer_kinds()) + self.vocab_size * self.hidden_size)


@dataclasses.dataclass(frozen=True)
class PartialRotaryMoEConfig(SigmoidMoEDecoderConfig):
    """A family whose every layer attends with the shared grouped-query attention, rotary on
    the first `partial_rotary_factor` of each head's dims (GLM-4.5, MiniMax-M2): the fields,
    the check and the count that attention adds; the family adds its biases and norms
    (`_attention_params`)."""

    rope_theta: float = field(10_000.0, "rotary base")
    partial_rotary_factor: float = field(0.5, "the share of each head's dims rotary rotates "
                                              "(the first ones)")

    def __post_init__(self):
        super().__post_init__()
        R = self.rotary_dim()
        if R % 2 or not 0 < R <= self.head_dim:
            raise UserError(f"--{self.section}.partial_rotary_factor="
                            f"{self.partial_rotary_factor} of head_dim={self.head_dim} is {R} "
                            f"rotary dims; expected an even number in 2..{self.head_dim}")

    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def rotary_widths(self) -> dict[str, int]:
        return {}  # the rotated share of a head is checked with partial_rotary_factor

    def flops_per_token(self, seq_length: int) -> float:
        width = self.num_attention_heads * self.head_dim
        return 6 * self.num_matmul_parameters() + 12 * width * seq_length * \
            self.num_hidden_layers


# ------------------------------------------------------------- config.json


def check_model_type(hf: dict, path: str, model_type: str):
    if hf.get("model_type") != model_type:
        raise UserError(f"{path}: model_type {hf.get('model_type')!r} is not {model_type}")


_TOLD: set[str] = set()  # the config.json files whose note was printed


def skip_mtp(path: str, layers):
    """Say that config.json's `layers` multi-token-prediction layers are not loaded: once
    per file and process (a command reads a config more than once)."""
    if layers and path not in _TOLD:
        _TOLD.add(path)
        print(f"{path}: its {layers} multi-token-prediction layer(s) are not loaded "
              f"(transformers skips them too)", file=sys.stderr)


def hf_common_fields(hf: dict, get) -> dict:
    """The non-integer fields both families read alike (`get`: hf_checkpoint.config_fields')."""
    return dict(routed_scaling_factor=float(get("routed_scaling_factor")),
                norm_topk_prob=bool(get("norm_topk_prob")),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                rms_norm_eps=float(get("rms_norm_eps")),
                initializer_range=float(get("initializer_range")),
                bos_token_id=hf.get("bos_token_id"), eos_token_id=_first(hf.get("eos_token_id")),
                pad_token_id=hf.get("pad_token_id"))


def _first(value):
    return value[0] if isinstance(value, (list, tuple)) and value else value


# ------------------------------------------------------------------ layers


class DecoderLayer(Sublayer):
    """x + attend(norm(x)), then x + MLP(norm(x)): a dense gated MLP (kind "dense") or the
    sigmoid-routed experts (kind "moe"). The correction bias is carried as a parameter,
    `mlp/e_score_correction_bias` (it gets no gradient: it only picks experts)."""

    norm_class: type = RMSNorm
    kind: str = "moe"

    def attend(self, x, context, positions, cache):
        """The family's attention (named "self_attn"): (output, cache)."""
        raise NotImplementedError

    @nn.compact
    def __call__(self, x, context, positions=None, cache=None):
        h, cache = self.attend(self.norm("input_layernorm")(x), context, positions, cache)
        x = x + h
        h = self.feed_forward(self.norm("post_attention_layernorm")(x), self.kind)
        return constrain(x + h, P(BATCH_AXES, None, None)), cache

    def feed_forward(self, h, kind: str):
        """The MLP of a layer of `kind` ("dense" or "moe"), named "mlp"."""
        c = self.config
        if kind == "dense":
            return GatedMLP(c, self.dtype, self.param_dtype, name="mlp")(h)
        h, stats = sigmoid_moe.SigmoidMoE(c.moe(), self.dtype, self.param_dtype,
                                          bias_collection="params", name="mlp")(h)
        self.sow("router", "stats", stats)
        return h


class SigmoidMoECausalLM(CausalLM):
    norm = RMSNorm


class PartialRotaryMoECausalLM(SigmoidMoECausalLM):
    """`PartialRotaryMoEConfig`'s rotary: cos and sin `rotary_dim()` wide, so that
    `apply_rotary` rotates the first R dims of each head only."""

    @classmethod
    def inv_freq(cls, config, kind: str):
        return jnp.asarray(rope.default(config.rope_theta, config.rotary_dim())[0])  # (R/2,)
