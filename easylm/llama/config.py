"""LLaMA model configuration: one dataclass, a table of named presets, HF conversion.

Presets are data. Each family states only what differs from the one it builds on,
so every field is written once:

    LLAMA_PRESETS['llama2_70b'] = {**_LLAMA2, **shape of 70B}

`LLaMAConfig.from_preset('llama3_8b', max_position_embeddings=4096)` applies
overrides on top. On the command line the same happens through
`--llama.base_model=llama3_8b --llama.max_position_embeddings=4096`.
"""

import dataclasses
from typing import Any

from easylm.errors import UserError
from easylm.models.config import ModelConfig, field, preset_config
from easylm.models.hf_checkpoint import first_int
from easylm.models.moe import ExpertMatmulConfig, MoEConfig, RouterLoss

ROPE_SCALING_TYPES = ("none", "llama3", "yarn")
# The LLaMA variants, by HF model_type: (their transformers class, the switches their
# config.json can set). What a model_type fixes, every config of it has: Qwen2's bias on
# q/k/v (`LLaMAConfig.qkv_bias`), Qwen3's RMS norm of each query and key head
# (`LLaMAConfig.qk_norm`).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", ("attention_bias", "mlp_bias")),
    "qwen2": ("Qwen2ForCausalLM", ("sliding_window",)),
    "qwen3": ("Qwen3ForCausalLM", ("attention_bias", "sliding_window")),
    "mistral": ("MistralForCausalLM", ("sliding_window",)),
    # LLaMA with every `no_rope_layer_interval`-th layer attending without rotary (NoPE).
    "smollm3": ("SmolLM3ForCausalLM", ("attention_bias", "mlp_bias", "no_rope_layers")),
    # Qwen3 and Mistral with every layer's MLP a mixture of experts (easylm/models/moe.py).
    "qwen3_moe": ("Qwen3MoeForCausalLM", ("attention_bias", "sliding_window")),
    "mixtral": ("MixtralForCausalLM", ("sliding_window",)),
}
SWITCHES = ("attention_bias", "mlp_bias", "sliding_window", "no_rope_layers")
MOE_TYPES = ("qwen3_moe", "mixtral")
# Mixture-of-experts models near these variants that are not built, by model_type: what
# in their config.json this model would compute differently (refused, never approximated).
NOT_BUILT = {
    "qwen2_moe": "shared_expert_intermediate_size (a shared expert beside the routed ones)",
    "deepseek_v2": "kv_lora_rank (multi-head latent attention) and n_shared_experts",
    "qwen3_next": "layer_types (linear-attention layers) and shared_expert_intermediate_size",
}
# What a config.json without a key means: its transformers class's default (transformers
# 5's LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config; None: derived, as the class
# derives it). tests/test_llama_config.py holds each against the class.
_HF_LLAMA = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
                 head_dim=None, max_position_embeddings=2048, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, initializer_range=0.02, bos_token_id=1,
                 eos_token_id=2, pad_token_id=None, hidden_act="silu", attention_bias=False,
                 mlp_bias=False)
_HF_QWEN2 = dict(_HF_LLAMA, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
                 max_position_embeddings=32768, bos_token_id=None, eos_token_id=None,
                 use_sliding_window=False, sliding_window=4096, max_window_layers=28)
HF_DEFAULTS = {
    "llama": _HF_LLAMA,
    "mistral": dict(_HF_LLAMA, intermediate_size=14336, num_key_value_heads=8,
                    max_position_embeddings=131072, sliding_window=4096),
    "qwen2": _HF_QWEN2,
    "qwen3": dict(_HF_QWEN2, head_dim=128),
    "smollm3": dict(_HF_LLAMA, vocab_size=128256, hidden_size=2048, num_hidden_layers=36,
                    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768,
                    pad_token_id=128004, bos_token_id=128000, eos_token_id=128001,
                    tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
                    no_rope_layers=None, no_rope_layer_interval=4),
    # Qwen3MoeConfig has no head_dim field: absent, the model derives it (as Qwen2).
    "qwen3_moe": dict(_HF_QWEN2, hidden_size=2048, intermediate_size=6144,
                      num_hidden_layers=24, num_key_value_heads=4, max_window_layers=None,
                      decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8,
                      num_experts=128, norm_topk_prob=False, output_router_logits=False,
                      router_aux_loss_coef=0.001, mlp_only_layers=None),
    "mixtral": dict(_HF_LLAMA, intermediate_size=14336, num_key_value_heads=8,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=None,
                    num_experts_per_tok=2, num_local_experts=8, output_router_logits=False,
                    router_aux_loss_coef=0.001, router_jitter_noise=0.0),
}
# transformers' rope_theta where config.json names none (MixtralConfig's default differs).
HF_ROPE_THETA = {"mixtral": 1000000.0, "smollm3": 2000000.0}


@dataclasses.dataclass(frozen=True)
class LLaMAConfig(ExpertMatmulConfig, ModelConfig):
    """LLaMA and its variants (Qwen2/3, Mistral, Qwen3-MoE, Mixtral): the shared fields
    (easylm/models/config.py) and these."""

    section = "llama"
    routed_experts_field = "num_experts"
    experts_per_token_field = "num_experts_per_tok"

    # Architecture: which LLaMA variant (HF's model_type) and its switches.
    model_type: str = field("llama", f"the variant, as HF's config.json names it: "
                                     f"{', '.join(ARCHITECTURES)} (qwen2: bias on q/k/v; "
                                     "qwen3: RMS norm of each query and key head)")
    attention_bias: bool = field(False, "bias on the q, k, v and o projections (llama, qwen3)")
    mlp_bias: bool = field(False, "bias on the gate, up and down projections (llama)")
    sliding_window: int = field(0, "each query attends to at most this many positions, "
                                   "itself included (qwen2, qwen3, mistral); 0: all")
    no_rope_layers: str = field("", "comma-separated indices of the layers that attend without "
                                    "rotary (NoPE, smollm3), e.g. '3,7,11'")
    # Mixture of experts (qwen3_moe, mixtral): every layer's MLP is easylm/models/moe.py's
    # block (a router, then the chosen experts' gated MLPs, weighted).
    num_experts: int = field(0, "experts E in each layer's mixture-of-experts MLP "
                                "(qwen3_moe, mixtral); 0: a dense MLP")
    num_experts_per_tok: int = field(2, "experts each token is routed to (K)")
    moe_intermediate_size: int = field(0, "one expert's MLP width (qwen3_moe; mixtral's is "
                                          "its intermediate_size)")
    norm_topk_prob: bool = field(False, "the K chosen probabilities divided by their sum "
                                        "(qwen3_moe's switch; mixtral always divides)")
    output_router_logits: bool = field(
        False, "train with router_aux_loss_coef x the load-balancing loss added, as "
              "transformers adds it with output_router_logits (logged either way)")
    router_aux_loss_coef: float = field(0.001, "weight of the load-balancing loss")
    router_z_loss_coef: float = field(0.0, "weight of ST-MoE's router z-loss added to the "
                                           "training loss (0: off; logged either way)")
    moe_capacity_factor: float = field(0.0, "an expert takes at most this x its even share "
                                            "of a batch shard's tokens, the rest dropped "
                                            "(counted in moe_dropped); 0: dropless")
    # Qwen3-MoE's dense layers among the sparse (its config.json fields): layer i has
    # experts iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; the
    # others a gated MLP of intermediate_size (`layer_kinds`).
    decoder_sparse_step: int = field(1, "every this-many-th layer has experts, the others a "
                                        "dense MLP (qwen3_moe)")
    mlp_only_layers: str = field("", "comma-separated layer indices with a dense MLP "
                                     "(qwen3_moe), e.g. '0,1'")
    # Numerics.
    rope_theta: float = field(10000.0, "rotary embedding base")
    rope_scaling_type: str = field("none", "rotary frequency scaling: "
                                           f"{' or '.join(ROPE_SCALING_TYPES)} (llama3: "
                                           "Llama-3.1 long-context scaling; yarn: "
                                           "Qwen's, with the paper's betas)")
    rope_scaling_factor: float = field(8.0, "llama3 or yarn rope scaling: factor")
    rope_low_freq_factor: float = field(1.0, "llama3 rope scaling: low-frequency factor")
    rope_high_freq_factor: float = field(4.0, "llama3 rope scaling: high-frequency factor")
    rope_original_max_position_embeddings: int = field(
        8192, "llama3 or yarn rope scaling: the context the model was pretrained at")
    # Carried to and from HF's config.json; the model has no use for it.
    unk_token_id: int | None = field(None, "unknown token id, carried to HF's config.json")
    # Implementation choices: none of these change the numbers.
    # One matmul for q, k and v, and one for gate and up, on kernels concatenated at
    # each step (parameters stay HF's). Meant for meshes without 'mp': a concatenation
    # of 'mp'-split kernels moves data between devices.
    fused_qkv: bool = field(False, "one matmul for q, k and v (kernels concatenated each "
                                   "step; for meshes without mp)")
    fused_mlp: bool = field(False, "one matmul for the gate and up projections (for meshes "
                                   "without mp)")

    def __post_init__(self):
        super().__post_init__()
        if self.model_type == "mixtral" and not self.moe_intermediate_size:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        self._check()

    def _check(self):
        def choice(field, allowed):
            value = getattr(self, field)
            if value not in allowed:
                raise UserError(
                    f"llama.{field}={value!r} is not one of {', '.join(allowed)}"
                )

        choice("rope_scaling_type", ROPE_SCALING_TYPES)
        choice("model_type", tuple(ARCHITECTURES))
        if self.sliding_window < 0:
            raise UserError(f"llama.sliding_window must be >= 0 (0: no window), got "
                            f"{self.sliding_window}")
        self._check_moe()
        allowed = ARCHITECTURES[self.model_type][1]
        for switch in SWITCHES:
            if getattr(self, switch) and switch not in allowed:
                others = [name for name, (_, s) in ARCHITECTURES.items() if switch in s]
                raise UserError(
                    f"llama.{switch}={getattr(self, switch)!r} is not part of model_type "
                    f"{self.model_type!r} (transformers' {ARCHITECTURES[self.model_type][0]} "
                    f"has no such switch); it is part of {', '.join(others)}")
        if self.intermediate_size < 1:
            raise UserError(f"llama.intermediate_size must be >= 1, got "
                            f"{self.intermediate_size}")

    def _check_moe(self):
        if self.decoder_sparse_step < 1:
            raise UserError(f"llama.decoder_sparse_step must be >= 1, got "
                            f"{self.decoder_sparse_step}")
        dense = self.dense_layers()
        if (self.decoder_sparse_step != 1 or dense) and self.model_type != "qwen3_moe":
            raise UserError(f"llama.decoder_sparse_step={self.decoder_sparse_step}, "
                            f"llama.mlp_only_layers={self.mlp_only_layers!r}: dense layers among "
                            f"the experts are qwen3_moe's, not {self.model_type}'s")
        if any(not 0 <= i < self.num_hidden_layers for i in self.nope_layers()):
            raise UserError(f"--llama.no_rope_layers={self.no_rope_layers!r}: a layer index "
                            f"outside 0..{self.num_hidden_layers - 1}")
        if any(not 0 <= i < self.num_hidden_layers for i in dense):
            raise UserError(f"llama.mlp_only_layers={self.mlp_only_layers!r}: a layer index "
                            f"outside 0..{self.num_hidden_layers - 1}")
        moe = self.model_type in MOE_TYPES
        if moe != (self.num_experts > 0):
            raise UserError(
                f"llama.num_experts={self.num_experts}: model_type {self.model_type!r} "
                + ("needs experts (num_experts >= 1)" if moe else
                   f"has a dense MLP (experts: model_type {' or '.join(MOE_TYPES)})"))
        if not moe:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise UserError(f"llama.num_experts_per_tok={self.num_experts_per_tok} must be "
                            f"in 1..num_experts={self.num_experts}")
        if self.model_type == "mixtral" and not self.norm_topk_prob:
            raise UserError("llama.norm_topk_prob=False: mixtral always divides the chosen "
                            "experts' probabilities by their sum")
        if self.model_type == "mixtral" and self.moe_intermediate_size != self.intermediate_size:
            raise UserError(f"llama.moe_intermediate_size={self.moe_intermediate_size}: "
                            f"mixtral's expert width is its intermediate_size="
                            f"{self.intermediate_size} (leave moe_intermediate_size unset)")
        if self.moe_intermediate_size < 1:
            raise UserError(f"llama.moe_intermediate_size must be >= 1, got "
                            f"{self.moe_intermediate_size}")

    # --------------------------------------------------- what the variant fixes

    @property
    def qkv_bias(self) -> bool:
        """Bias on the q, k and v projections: Qwen2's always, and `attention_bias`'s."""
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """RMS norm (weights of size H) of each query and key head before rotary: Qwen3's."""
        return self.model_type in ("qwen3", "qwen3_moe")

    def dense_layers(self) -> tuple[int, ...]:
        """mlp_only_layers as indices."""
        try:
            return tuple(int(i) for i in self.mlp_only_layers.replace(" ", "").split(",") if i)
        except ValueError:
            raise UserError(f"llama.mlp_only_layers={self.mlp_only_layers!r}: expected "
                            f"comma-separated layer indices") from None

    def nope_layers(self) -> tuple[int, ...]:
        """no_rope_layers as indices."""
        try:
            return tuple(int(i) for i in self.no_rope_layers.replace(" ", "").split(",") if i)
        except ValueError:
            raise UserError(f"--llama.no_rope_layers={self.no_rope_layers!r}: expected "
                            f"comma-separated layer indices") from None

    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind: "dense" where Qwen3-MoE's layout gives a layer a gated MLP
        among the experts, "no_rope" for SmolLM3's layers without rotary, else
        "full_attention" (every other layer of a dense model, every sparse layer)."""
        if not self.num_experts:
            nope = set(self.nope_layers())
            return tuple("no_rope" if i in nope else "full_attention"
                         for i in range(self.num_hidden_layers))
        dense = set(self.dense_layers())
        return tuple("dense" if i in dense or (i + 1) % self.decoder_sparse_step else
                     "full_attention" for i in range(self.num_hidden_layers))

    def shard_variant(self, layers: int, mp: int):
        """The planner's few layers keep SmolLM3's mix of NoPE layers (as a config with
        layer_types keeps its mix)."""
        kinds = self.layer_kinds()
        picked = [kinds[i * len(kinds) // layers] for i in range(layers)]
        nope = ",".join(str(i) for i, kind in enumerate(picked) if kind == "no_rope")
        fewer = self.replace(num_hidden_layers=layers, no_rope_layers=nope)
        return super(LLaMAConfig, fewer).shard_variant(layers, mp)

    @property
    def moe(self):
        """The mixture-of-experts block's config (easylm/models/moe.py), None: dense MLP."""
        if not self.num_experts:
            return None
        return MoEConfig(self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size,
                         norm_topk_prob=self.norm_topk_prob,
                         capacity_factor=self.moe_capacity_factor, matmul=self.moe_matmul,
                         initializer_range=self.initializer_range)

    # ----------------------------------------------------------------- presets

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "LLaMAConfig":
        return preset_config(cls, LLAMA_PRESETS, name, "llama", **overrides)

    def unfused(self) -> "LLaMAConfig":
        return self.replace(fused_qkv=False, fused_mlp=False)

    def router_loss(self) -> RouterLoss | None:
        if not self.num_experts:
            return None
        aux = self.router_aux_loss_coef if self.output_router_logits else 0.0
        return RouterLoss(self.num_experts_per_tok, aux, self.router_z_loss_coef)

    # --------------------------------------------------------------- counting

    def num_parameters(self) -> int:
        """Parameters of the model as built (embeddings counted once when tied)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        layer = d * (q + 2 * kv) + q * d + self._vectors_per_layer()
        head = 0 if self.tie_word_embeddings else v * d
        mlps = sum(self._mlp_parameters(kind) for kind in self.layer_kinds())
        return v * d + self.num_hidden_layers * layer + mlps + d + head

    def _mlp_parameters(self, kind: str, active: bool = False) -> int:
        """The MLP matrices of a layer of `kind`: gate, up and down, of every expert (or,
        `active`, of the K a token is routed to) and the router, or of the dense MLP."""
        d = self.hidden_size
        if not self.num_experts or kind == "dense":
            return 3 * d * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        return experts * 3 * d * self.moe_intermediate_size + d * self.num_experts

    def num_active_parameters(self) -> int:
        """Parameters a token's forward pass reads: all but the experts it is not routed
        to (= num_parameters for a dense model)."""
        inactive = sum(self._mlp_parameters(kind) - self._mlp_parameters(kind, active=True)
                       for kind in self.layer_kinds())
        return self.num_parameters() - inactive

    def _vectors_per_layer(self) -> int:
        """A layer's parameters outside its matmuls: norms and biases."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * h, self.num_key_value_heads * h
        return (2 * d + (q + 2 * kv if self.qkv_bias else 0) + (d if self.attention_bias else 0)
                + (2 * f + d if self.mlp_bias else 0) + (2 * h if self.qk_norm else 0))

    def num_matmul_parameters(self) -> int:
        """Parameters that take part in a matmul per token: all but the input embedding,
        the norms and the biases (the output projection counts, tied or not), and of a
        mixture of experts only the experts a token is routed to. This is N in the 6*N
        FLOPs-per-token rule."""
        d, v = self.hidden_size, self.vocab_size
        vectors = self.num_hidden_layers * self._vectors_per_layer() + d
        head = v * d if self.tie_word_embeddings else 0
        return self.num_active_parameters() - v * d - vectors + head

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token: 6*N + 12*L*d_attn*keys (PaLM appendix B; the second
        term is the attention score and value matmuls, forward and backward, over the
        keys a query sees: seq, or the sliding window when shorter)."""
        attn_width = self.num_attention_heads * self.head_dim
        keys = min(seq_length, self.sliding_window or seq_length)
        return 6 * self.num_matmul_parameters() + 12 * self.num_hidden_layers * attn_width * keys

    # ---------------------------------------------------- HF transformers

    def to_hf_config(self):
        """The transformers config of this variant (LlamaConfig, Qwen2Config, Qwen3Config or
        MistralConfig) with `architectures` set: `save_pretrained` then writes a config.json
        that AutoModelForCausalLM loads as this model."""
        import transformers

        architecture = ARCHITECTURES[self.model_type][0]
        config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
        rope = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        if self.rope_scaling_type == "yarn":
            rope.update(rope_type="yarn", factor=float(self.rope_scaling_factor),
                        original_max_position_embeddings=int(
                            self.rope_original_max_position_embeddings))
        if self.rope_scaling_type == "llama3":
            rope.update(
                rope_type="llama3",
                factor=float(self.rope_scaling_factor),
                low_freq_factor=float(self.rope_low_freq_factor),
                high_freq_factor=float(self.rope_high_freq_factor),
                original_max_position_embeddings=int(self.rope_original_max_position_embeddings),
            )
        optional = {name: getattr(self, name) for name in ("pad_token_id", "unk_token_id")
                    if getattr(self, name) is not None}
        # Qwen2Config has no head_dim field (Qwen2 reads one when config.json has it).
        default_head_dim = self.hidden_size // self.num_attention_heads
        if self.model_type != "qwen2" or self.head_dim != default_head_dim:
            optional["head_dim"] = self.head_dim
        fields = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            hidden_act="silu",
            **self._hf_switches(),
            **optional,
        )
        config = config_class(**{**fields, **self._hf_moe()})
        config.architectures = [architecture]
        return config

    def _hf_moe(self) -> dict:
        """The experts as this variant's config.json spells them."""
        if not self.num_experts:
            return {}
        common = dict(num_experts_per_tok=self.num_experts_per_tok,
                      output_router_logits=self.output_router_logits,
                      router_aux_loss_coef=self.router_aux_loss_coef)
        if self.model_type == "mixtral":
            return dict(common, num_local_experts=self.num_experts)
        return dict(common, num_experts=self.num_experts, norm_topk_prob=self.norm_topk_prob,
                    moe_intermediate_size=self.moe_intermediate_size,
                    decoder_sparse_step=self.decoder_sparse_step,
                    mlp_only_layers=list(self.dense_layers()))

    def _hf_switches(self) -> dict:
        """The switches as this variant's config.json spells them."""
        if self.model_type == "llama":
            return dict(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
        if self.model_type in ("mistral", "mixtral"):
            return dict(sliding_window=self.sliding_window or None)
        if self.model_type == "smollm3":  # no_rope_layers: 1 where a layer rotates
            nope = set(self.nope_layers())
            return dict(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias,
                        use_sliding_window=False, no_rope_layers=[
                            int(i not in nope) for i in range(self.num_hidden_layers)])
        # Qwen: the window on every layer (those from max_window_layers on slide), or none;
        # Qwen3-MoE slides every layer with use_sliding_window.
        out = dict(use_sliding_window=False)
        if self.sliding_window:
            out = dict(use_sliding_window=True, sliding_window=self.sliding_window)
            if self.model_type != "qwen3_moe":
                out["max_window_layers"] = 0
        if self.model_type in ("qwen3", "qwen3_moe"):
            out["attention_bias"] = self.attention_bias
        return out

    @classmethod
    def from_hf_config(cls, hf_config, **overrides) -> "LLaMAConfig":
        """From a transformers config of a LLaMA variant (or its dict); what this model
        would compute differently is a UserError that names the field."""
        hf = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        model_type = hf.get("model_type", "llama")
        if model_type not in ARCHITECTURES:
            raise UserError(f"model_type {model_type!r} is not a LLaMA variant (supported: "
                            f"{', '.join(ARCHITECTURES)})")
        get = _reader(model_type, hf)
        if get("hidden_act") != "silu":
            raise UserError(f"hidden_act {hf['hidden_act']!r} is not supported (LLaMA uses silu)")
        # transformers >= 5 keeps rope_theta inside rope_parameters; older config.json
        # files have rope_theta and rope_scaling at the top level. Where both are, HF
        # reads rope_scaling, and so do we.
        rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        rope_theta = rope.get("rope_theta", hf.get("rope_theta",
                                                   HF_ROPE_THETA.get(model_type, 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        fields = dict(
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_hidden_layers=get("num_hidden_layers"),
            num_attention_heads=get("num_attention_heads"),
            num_key_value_heads=get("num_key_value_heads"),
            head_dim=get("head_dim"),
            max_position_embeddings=get("max_position_embeddings"),
            rms_norm_eps=get("rms_norm_eps"),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            initializer_range=get("initializer_range"),
            bos_token_id=first_int(get("bos_token_id")),
            eos_token_id=first_int(get("eos_token_id")),
            pad_token_id=first_int(get("pad_token_id")),
            unk_token_id=first_int(hf.get("unk_token_id")),
            model_type=model_type,
            **_switches_from_hf(model_type, get),
            **_moe_from_hf(model_type, hf, get),
        )
        if rope_type == "llama3":
            fields.update(
                rope_scaling_type="llama3",
                rope_scaling_factor=float(rope["factor"]),
                rope_low_freq_factor=float(rope["low_freq_factor"]),
                rope_high_freq_factor=float(rope["high_freq_factor"]),
                rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "yarn":
            fields.update(_yarn_from_hf(rope, fields["max_position_embeddings"]))
        elif rope_type != "default":
            raise UserError(f"rope type {rope_type!r} is not supported (supported: default, "
                            f"llama3, yarn)")
        return cls(**{**fields, **overrides})


# YaRN's settings a LLaMA variant leaves at transformers' defaults (Qwen's long-context
# configs give only factor and original_max_position_embeddings).
_YARN_DEFAULTS = dict(beta_fast=(None, 32), beta_slow=(None, 1), truncate=(None, True),
                      attention_factor=(None,), mscale=(None,), mscale_all_dim=(None,))


def _yarn_from_hf(rope: dict, max_position_embeddings) -> dict:
    for name, allowed in _YARN_DEFAULTS.items():
        if rope.get(name) not in allowed:
            raise UserError(f"rope_scaling.{name}={rope[name]!r} is not supported for a LLaMA "
                            f"variant's yarn rope (supported: {allowed[-1]!r})")
    original = rope.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool):
        raise UserError(f"rope_scaling: a yarn rope needs an integer "
                        f"original_max_position_embeddings, got {original!r}")
    factor = rope.get("factor") or max_position_embeddings / original  # as transformers
    return dict(rope_scaling_type="yarn", rope_scaling_factor=float(factor),
                rope_original_max_position_embeddings=original)


def _reader(model_type: str, hf: dict):
    """config.json's value of a field, as its transformers class reads it: absent, the
    class default; null, None (which the class, and LLaMAConfig, derive where they can)."""
    defaults = HF_DEFAULTS[model_type]
    return lambda name: hf[name] if name in hf else defaults.get(name)


def _switches_from_hf(model_type: str, get) -> dict:
    """The variant's switches from config.json, read as its transformers class reads them
    (a field the class does not read, e.g. Qwen2's attention_bias, changes nothing)."""
    switches = ARCHITECTURES[model_type][1]
    out = {name: bool(get(name) or False) for name in ("attention_bias", "mlp_bias")
           if name in switches}
    if "sliding_window" in switches:
        out["sliding_window"] = _sliding_window(model_type, get)
    if "no_rope_layers" in switches:
        out["no_rope_layers"] = _nope_layers(get)
    return out


def _nope_layers(get) -> str:
    """SmolLM3's layers without rotary as SmolLM3Config reads them: `no_rope_layers` (1: the
    layer rotates, 0: NoPE), else every `no_rope_layer_interval`-th layer NoPE. Its window
    (use_sliding_window) falls on the NoPE layers only, which is refused."""
    if get("use_sliding_window") and get("sliding_window"):
        raise UserError(f"use_sliding_window=true with sliding_window={get('sliding_window')} "
                        f"slides SmolLM3's NoPE layers only: a window on some layers only is "
                        f"not supported")
    layers, interval = get("num_hidden_layers"), get("no_rope_layer_interval")
    flags = get("no_rope_layers")
    if flags is None:
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise UserError(f"no_rope_layer_interval must be a positive integer, got "
                            f"{interval!r}")
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) < layers or \
            any(flag not in (0, 1) for flag in flags):
        raise UserError(f"no_rope_layers must list 0 or 1 for each of the {layers} layers, got "
                        f"{flags!r}")
    return ",".join(str(i) for i in range(layers) if not flags[i])


def _moe_from_hf(model_type: str, hf: dict, get) -> dict:
    """The experts from config.json, as Qwen3MoeConfig / MixtralConfig read it; a layout
    this model would compute differently (dense layers among the sparse ones, router
    noise) is refused by the field."""
    if model_type not in MOE_TYPES:
        return {}
    out = dict(num_experts_per_tok=get("num_experts_per_tok"),
               output_router_logits=bool(get("output_router_logits")),
               router_aux_loss_coef=float(get("router_aux_loss_coef")))
    if model_type == "mixtral":
        if get("router_jitter_noise"):
            raise UserError(f"router_jitter_noise={get('router_jitter_noise')!r} (noise on "
                            f"the router's input while training) is not supported; 0.0 is")
        return dict(out, num_experts=get("num_local_experts"), norm_topk_prob=True)
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts.
    experts = hf.get("num_experts", hf.get("num_local_experts", get("num_experts")))
    dense = get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise UserError(f"mlp_only_layers must be a list of layer indices, got {dense!r}")
    return dict(out, num_experts=experts, moe_intermediate_size=get("moe_intermediate_size"),
                norm_topk_prob=bool(get("norm_topk_prob")),
                decoder_sparse_step=get("decoder_sparse_step"),
                mlp_only_layers=",".join(map(str, dense)))


def _sliding_window(model_type: str, get) -> int:
    """The window of every layer (0: none) as transformers 5 reads config.json: Mistral
    slides every layer unless `sliding_window` is null; Qwen2/3 only with
    `use_sliding_window`, and then the layers `layer_types` says (derived, when absent,
    from max_window_layers: layers from that index on slide); Qwen3-MoE every layer with
    `use_sliding_window`; Mixtral as Mistral. The classes' window, where
    config.json names none, is 4096. A window on some layers only is refused."""
    window = get("sliding_window")
    if model_type in ("mistral", "mixtral") or not window:
        return int(window or 0)
    if not get("use_sliding_window"):
        return 0
    if model_type == "qwen3_moe":  # every layer slides
        return int(window)
    layers = get("num_hidden_layers")
    first = get("max_window_layers")
    types = get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                   for i in range(layers)]
    sliding = sum(kind == "sliding_attention" for kind in types)
    if sliding == 0:
        return 0
    if sliding == len(types):
        return int(window)
    source = "layer_types" if get("layer_types") else f"max_window_layers={first}"
    raise UserError(f"use_sliding_window=true with {source} slides {sliding} of {len(types)} "
                    f"layers: a window on some layers only is not supported")




# -------------------------------------------------------------------- presets
# Shapes as published: LLaMA 1 (Touvron et al. 2023a), OpenLLaMA 3B, LLaMA 2
# (2023b), Llama 3 / 3.2 (Meta's released config.json files). `llama_1b` is
# EasyLM's 1B shape, used by the benchmarks.

_LLAMA1 = dict(vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-6,
               bos_token_id=1, eos_token_id=2)
_LLAMA2 = dict(_LLAMA1, max_position_embeddings=4096, rms_norm_eps=1e-5)
_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=500000.0, num_key_value_heads=8,
               bos_token_id=128000, eos_token_id=128001)
_LLAMA3_2 = dict(_LLAMA3, max_position_embeddings=131072, tie_word_embeddings=True,
                 rope_scaling_type="llama3", rope_scaling_factor=32.0,
                 rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_max_position_embeddings=8192, eos_token_id=128009)


# Qwen2.5 (base models), Qwen3 and Mistral 7B v0.1, as their config.json files on the
# Hugging Face hub have them. Written from knowledge, not downloaded (no hub access where
# this was written): tests/test_llama_config.py checks them against the parameter counts
# the model cards publish. Qwen2.5's sliding_window fields are off (use_sliding_window:
# false) in every released config, so they are left out.
_QWEN2_5 = dict(model_type="qwen2", vocab_size=151936, max_position_embeddings=32768,
                rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643,
                eos_token_id=151643)
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, max_position_embeddings=40960,
              rms_norm_eps=1e-6, rope_theta=1000000.0, head_dim=128, num_key_value_heads=8,
              bos_token_id=151643, eos_token_id=151645)
_MISTRAL = dict(model_type="mistral", vocab_size=32000, max_position_embeddings=32768,
                rms_norm_eps=1e-5, rope_theta=10000.0, num_key_value_heads=8,
                sliding_window=4096, bos_token_id=1, eos_token_id=2)


def _shape(d, f, layers, heads, **extra):
    return dict(hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
                num_attention_heads=heads, **extra)


LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    # Tiny and fast, for tests: GQA (4 heads, 2 kv heads) and every dimension
    # divisible by 8 so any (dp, fsdp, mp) mesh of 8 devices shards it.
    "debug": dict(vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2,
                  **_shape(64, 128, 2, 4, num_key_value_heads=2)),
    # The default run's model (python -m easylm.llama.train): debug's vocabulary (the
    # embedded tokenizer's 512 tokens) with a wider, deeper body that learns the
    # embedded corpus in about three minutes on two CPU cores.
    "embedded": dict(vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6,
                     bos_token_id=1, eos_token_id=2,
                     **_shape(128, 384, 4, 4, num_key_value_heads=2)),
    "llama_1b": dict(_LLAMA1, **_shape(2048, 5504, 22, 16)),
    "llama_3b": dict(_LLAMA1, **_shape(3200, 8640, 26, 32)),
    "llama_7b": dict(_LLAMA1, **_shape(4096, 11008, 32, 32)),
    "llama_13b": dict(_LLAMA1, **_shape(5120, 13824, 40, 40)),
    "llama_30b": dict(_LLAMA1, **_shape(6656, 17920, 60, 52)),
    "llama_65b": dict(_LLAMA1, **_shape(8192, 22016, 80, 64)),
    "llama2_7b": dict(_LLAMA2, **_shape(4096, 11008, 32, 32)),
    "llama2_13b": dict(_LLAMA2, **_shape(5120, 13824, 40, 40)),
    "llama2_70b": dict(_LLAMA2, **_shape(8192, 28672, 80, 64, num_key_value_heads=8)),
    "llama3_8b": dict(_LLAMA3, **_shape(4096, 14336, 32, 32)),
    "llama3_70b": dict(_LLAMA3, **_shape(8192, 28672, 80, 64)),
    "llama3.2_1b": dict(_LLAMA3_2, **_shape(2048, 8192, 16, 32, head_dim=64)),
    "llama3.2_3b": dict(_LLAMA3_2, **_shape(3072, 8192, 28, 24, head_dim=128)),
    "qwen2.5_0.5b": dict(_QWEN2_5, tie_word_embeddings=True,
                         **_shape(896, 4864, 24, 14, num_key_value_heads=2)),
    "qwen2.5_1.5b": dict(_QWEN2_5, tie_word_embeddings=True, max_position_embeddings=131072,
                         **_shape(1536, 8960, 28, 12, num_key_value_heads=2)),
    "qwen2.5_7b": dict(_QWEN2_5, vocab_size=152064, max_position_embeddings=131072,
                       **_shape(3584, 18944, 28, 28, num_key_value_heads=4)),
    "qwen3_0.6b": dict(_QWEN3, tie_word_embeddings=True, **_shape(1024, 3072, 28, 16)),
    "qwen3_1.7b": dict(_QWEN3, tie_word_embeddings=True, **_shape(2048, 6144, 28, 16)),
    "qwen3_4b": dict(_QWEN3, tie_word_embeddings=True, **_shape(2560, 9728, 36, 32)),
    "qwen3_8b": dict(_QWEN3, **_shape(4096, 12288, 36, 32)),
    "mistral_7b": dict(_MISTRAL, **_shape(4096, 14336, 32, 32)),
    # HuggingFaceTB/SmolLM3-3B's config.json (written from knowledge): every 4th layer NoPE,
    # tied embeddings, the Llama 3 vocabulary, 65,536 positions at rope_theta 5e6.
    "smollm3_3b": dict(model_type="smollm3", vocab_size=128256, max_position_embeddings=65536,
                       rms_norm_eps=1e-6, rope_theta=5_000_000.0, tie_word_embeddings=True,
                       bos_token_id=128000, eos_token_id=128012, pad_token_id=128004,
                       no_rope_layers=",".join(str(i) for i in range(3, 36, 4)),
                       **_shape(2048, 11008, 36, 16, num_key_value_heads=4)),
    # Mixtures of experts: Qwen3-30B-A3B (30.5B parameters, 3.3B active) and
    # Mixtral-8x7B-v0.1 (46.7B, 12.9B active), as their config.json files have them
    # (written from knowledge, checked against the model cards' counts in
    # tests/test_llama_config.py). Mixtral's intermediate_size is its expert width.
    "qwen3_30b_a3b": dict(_QWEN3, model_type="qwen3_moe", num_key_value_heads=4,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, **_shape(2048, 6144, 48, 32)),
    "mixtral_8x7b": dict(_MISTRAL, model_type="mixtral", rope_theta=1000000.0,
                         sliding_window=0, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True,
                         router_aux_loss_coef=0.02, **_shape(4096, 14336, 32, 32)),
    # debug's shape with 8 experts of width 32, 2 per token, trained with the
    # load-balancing loss (output_router_logits): the tests' and demos' MoE.
    "debug_moe": dict(vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6,
                      bos_token_id=1, eos_token_id=2, model_type="qwen3_moe", num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      output_router_logits=True, **_shape(64, 128, 2, 4, num_key_value_heads=2)),
}
