"""Llama 4's text model (Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E; transformers'
`Llama4TextConfig`, model_type llama4_text): one dataclass, presets, config.json.

Layers differ in two ways, each a list of indices: `no_rope_layers` attend without rotary
over the whole context (NoPE, every 4th in the released models), the others with rotary
over their chunk of `attention_chunk_size` positions; `moe_layers` have the mixture of
experts (a router, `num_local_experts` experts of `intermediate_size`, a shared expert),
the others a dense gated MLP of `intermediate_size_mlp` (Maverick interleaves them).
"""

import dataclasses

from easylm.errors import UserError
from easylm.models.config import ModelConfig, default, field
from easylm.models.hf_checkpoint import config_fields, first_int
from easylm.models.moe import ExpertMatmulConfig, MoEConfig, RouterLoss

ROPE_SCALING_TYPES = ("none", "llama3")
# transformers' Llama4TextConfig defaults, for keys a config.json leaves out.
HF_DEFAULTS = dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192,
                   intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40,
                   num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, initializer_range=0.02, num_experts_per_tok=1,
                   num_local_experts=16, interleave_moe_layer_step=1, use_qk_norm=True,
                   no_rope_layer_interval=4, attention_chunk_size=8192,
                   attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
                   attention_bias=False, bos_token_id=1, eos_token_id=2, hidden_act="silu")
_INTS = ("vocab_size", "hidden_size", "intermediate_size", "intermediate_size_mlp",
         "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "max_position_embeddings", "num_experts_per_tok", "num_local_experts",
         "interleave_moe_layer_step", "no_rope_layer_interval", "floor_scale")


def _indices(text: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(i) for i in text.replace(" ", "").split(",") if i)
    except ValueError:
        raise UserError(f"--llama4.{name}={text!r}: expected comma-separated layer "
                        f"indices") from None


@dataclasses.dataclass(frozen=True)
class Llama4Config(ExpertMatmulConfig, ModelConfig):
    section = "llama4"
    routed_experts_field = "num_local_experts"
    experts_per_token_field = "num_experts_per_tok"

    vocab_size: int = default(202048)
    rms_norm_eps: float = default(1e-5)
    intermediate_size_mlp: int = field(16384, "the dense layers' MLP width")
    num_local_experts: int = field(16, "routed experts E of each MoE layer")
    num_experts_per_tok: int = field(1, "experts a token takes (1: Llama 4's experts weigh "
                                        "their input by the router's score)")
    moe_layers: str = field("", "comma-separated indices of the layers with experts; the "
                                "others a dense MLP of intermediate_size_mlp")
    no_rope_layers: str = field("", "comma-separated indices of the NoPE layers (no rotary, "
                                    "the whole context); the others rotary and chunked")
    attention_chunk_size: int = field(8192, "a rotary layer's query sees its own chunk of "
                                            "this many positions; 0: the whole context")
    use_qk_norm: bool = field(True, "a weightless RMS norm of the rotary layers' queries and "
                                    "keys after rotary")
    attn_temperature_tuning: bool = field(
        True, "NoPE layers multiply the query at position p by 1 + attn_scale * "
              "log(1 + floor((p + 1) / floor_scale))")
    floor_scale: int = field(8192, "temperature tuning's step in positions")
    attn_scale: float = field(0.1, "temperature tuning's strength")
    attention_bias: bool = field(False, "biases on q, k, v, o")
    rope_theta: float = field(500000.0, "rotary base")
    rope_scaling_type: str = field("none", "none or llama3 (Llama 3.1's long-context scaling)")
    rope_scaling_factor: float = field(8.0, "llama3 rope scaling: factor")
    rope_low_freq_factor: float = field(1.0, "llama3 rope scaling: low-frequency factor")
    rope_high_freq_factor: float = field(4.0, "llama3 rope scaling: high-frequency factor")
    rope_original_max_position_embeddings: int = field(8192, "llama3 rope scaling: the "
                                                             "pretraining context")
    router_aux_loss_coef: float = field(0.0, "weight of the load-balancing loss added to "
                                             "training (0: logged only, as transformers)")

    def __post_init__(self):
        super().__post_init__()
        def fail(message):
            raise UserError(f"--llama4.{message}")

        for name in ("moe_layers", "no_rope_layers"):
            if any(not 0 <= i < self.num_hidden_layers for i in _indices(getattr(self, name),
                                                                          name)):
                fail(f"{name}={getattr(self, name)!r}: a layer index outside "
                     f"0..{self.num_hidden_layers - 1}")
        if self.rope_scaling_type not in ROPE_SCALING_TYPES:
            fail(f"rope_scaling_type={self.rope_scaling_type!r} is not one of "
                 f"{', '.join(ROPE_SCALING_TYPES)}")
        if self.num_experts_per_tok != 1:
            fail(f"num_experts_per_tok={self.num_experts_per_tok}: Llama 4's experts weigh "
                 f"their input by the router's score, built for one expert a token (the "
                 f"released models')")
        for name, least in (("num_local_experts", 2), ("attention_chunk_size", 0),
                            ("floor_scale", 1)):
            if getattr(self, name) < least:
                fail(f"{name}={getattr(self, name)} must be >= {least}")

    # ------------------------------------------------------------------ layers

    def nope(self, i: int) -> bool:
        return i in _indices(self.no_rope_layers, "no_rope_layers")

    def layer_kinds(self) -> tuple[str, ...]:
        """'<rope|nope>_<moe|dense>' a layer (a rotary layer is chunked with a chunk)."""
        moe = set(_indices(self.moe_layers, "moe_layers"))
        return tuple(f"{'nope' if self.nope(i) else 'rope'}_{'moe' if i in moe else 'dense'}"
                     for i in range(self.num_hidden_layers))

    def moe(self) -> MoEConfig:
        return MoEConfig(self.num_local_experts, self.num_experts_per_tok,
                         self.intermediate_size, router="topk_sigmoid",
                         initializer_range=self.initializer_range, matmul=self.moe_matmul)

    def router_loss(self) -> RouterLoss:
        return RouterLoss(self.num_experts_per_tok, self.router_aux_loss_coef)

    def shard_variant(self, layers: int, mp: int):
        # The first `layers` layers' kinds (at least one of experts where the model has them).
        keep = lambda text: ",".join(str(i) for i in _indices(text, "") if i < layers)
        moe = keep(self.moe_layers) or (str(layers - 1) if self.moe_layers else "")
        trimmed = self.replace(moe_layers=moe, no_rope_layers=keep(self.no_rope_layers))
        return super(Llama4Config, trimmed).shard_variant(layers, mp).replace(
            intermediate_size_mlp=-(-self.intermediate_size_mlp // mp))

    # --------------------------------------------------------------- counting

    def _layer_params(self, kind: str, active: bool = False) -> int:
        d, h = self.hidden_size, self.head_dim
        n, k = self.num_attention_heads, self.num_key_value_heads
        attention = d * (n + 2 * k) * h + n * h * d
        if self.attention_bias:
            attention += (n + 2 * k) * h + d
        if kind.endswith("dense"):
            return attention + 3 * d * self.intermediate_size_mlp + 2 * d
        experts = self.num_experts_per_tok if active else self.num_local_experts
        return attention + 3 * d * self.intermediate_size * (experts + 1) + \
            d * self.num_local_experts + 2 * d

    def num_parameters(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + sum(map(self._layer_params, self.layer_kinds())) + self.hidden_size

    def num_matmul_parameters(self) -> int:
        return self.vocab_size * self.hidden_size + sum(
            self._layer_params(kind, True) for kind in self.layer_kinds())

    def flops_per_token(self, seq_length: int) -> float:
        """6N + 12 d_attn keys per layer (PaLM appendix B), a chunked layer's keys its chunk."""
        chunk = self.attention_chunk_size or seq_length
        keys = [seq_length if kind.startswith("nope") else min(seq_length, chunk)
                for kind in self.layer_kinds()]
        width = self.num_attention_heads * self.head_dim
        return 6 * self.num_matmul_parameters() + 12 * width * sum(keys)

    # ---------------------------------------------------- HF transformers

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "Llama4Config":
        if hf.get("model_type") != "llama4_text":
            raise UserError(f"{path}: model_type {hf.get('model_type')!r} is not llama4_text")
        get = config_fields(hf, path, HF_DEFAULTS, _INTS, {"hidden_act": "silu"}, "Llama 4")
        layers = get("num_hidden_layers")
        if hf.get("router_jitter_noise"):
            raise UserError(f"{path}: router_jitter_noise={hf['router_jitter_noise']!r} is "
                            f"not supported; 0.0 is")
        rope_flags = hf.get("no_rope_layers") or [
            int((i + 1) % get("no_rope_layer_interval") != 0) for i in range(layers)]
        moe = hf.get("moe_layers")
        if moe is None:
            step = get("interleave_moe_layer_step")
            moe = list(range(step - 1, layers, step))
        chunk = hf.get("attention_chunk_size", HF_DEFAULTS["attention_chunk_size"])
        derived = ["chunked_attention" if flag and chunk is not None else "full_attention"
                   for flag in rope_flags]
        if hf.get("layer_types") not in (None, derived):
            raise UserError(f"{path}: layer_types {hf['layer_types']!r} differ from what "
                            f"no_rope_layers and attention_chunk_size make ({derived}): "
                            f"chunks on other layers than the rotary ones are not supported")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        fields = {}
        if rope_type == "llama3":
            fields = dict(rope_scaling_type="llama3", rope_scaling_factor=float(rope["factor"]),
                          rope_low_freq_factor=float(rope["low_freq_factor"]),
                          rope_high_freq_factor=float(rope["high_freq_factor"]),
                          rope_original_max_position_embeddings=int(
                              rope["original_max_position_embeddings"]))
        elif rope_type != "default":
            raise UserError(f"{path}: rope type {rope_type!r} is not supported (default, "
                            f"llama3)")
        try:
            return cls(**{name: get(name) for name in _INTS if name not in (
                "interleave_moe_layer_step", "no_rope_layer_interval")},
                moe_layers=",".join(map(str, moe)),
                no_rope_layers=",".join(str(i) for i, flag in enumerate(rope_flags) if not flag),
                attention_chunk_size=chunk or 0, use_qk_norm=bool(get("use_qk_norm")),
                attn_temperature_tuning=bool(get("attn_temperature_tuning")),
                attn_scale=float(get("attn_scale")), attention_bias=bool(get("attention_bias")),
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 500000.0))),
                rms_norm_eps=float(get("rms_norm_eps")),
                initializer_range=float(get("initializer_range")),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                bos_token_id=first_int(get("bos_token_id")),
                eos_token_id=first_int(get("eos_token_id")),
                pad_token_id=first_int(hf.get("pad_token_id")), **fields)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None

    def to_hf_config(self):
        from transformers import Llama4TextConfig

        rope = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        if self.rope_scaling_type == "llama3":
            rope.update(rope_type="llama3", factor=self.rope_scaling_factor,
                        low_freq_factor=self.rope_low_freq_factor,
                        high_freq_factor=self.rope_high_freq_factor,
                        original_max_position_embeddings=self.rope_original_max_position_embeddings)
        layers = range(self.num_hidden_layers)
        config = Llama4TextConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            intermediate_size_mlp=self.intermediate_size_mlp,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps, initializer_range=self.initializer_range,
            num_experts_per_tok=self.num_experts_per_tok,
            num_local_experts=self.num_local_experts,
            moe_layers=list(_indices(self.moe_layers, "moe_layers")),
            no_rope_layers=[int(not self.nope(i)) for i in layers],
            attention_chunk_size=self.attention_chunk_size or None,
            use_qk_norm=self.use_qk_norm, attn_temperature_tuning=self.attn_temperature_tuning,
            floor_scale=self.floor_scale, attn_scale=self.attn_scale,
            attention_bias=self.attention_bias, rope_parameters=rope,
            tie_word_embeddings=self.tie_word_embeddings, bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
        config.architectures = ["Llama4ForCausalLM"]
        return config


def _every(step: int, layers: int, first: int) -> str:
    return ",".join(str(i) for i in range(first, layers, step))


_LLAMA4 = dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192,
               intermediate_size_mlp=16384, num_attention_heads=40, num_key_value_heads=8,
               head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, attention_chunk_size=8192,
               bos_token_id=200000, eos_token_id=200008, pad_token_id=200018,
               no_rope_layers=_every(4, 48, 3))
LLAMA4_PRESETS = {
    # Tiny, for tests and the commands' default: the embedded tokenizer's 512 tokens, a
    # chunk of 16, layers 0, 2 rotary and chunked with experts, 1 NoPE dense, 3 NoPE MoE.
    "debug": dict(vocab_size=512, hidden_size=64, intermediate_size=32,
                  intermediate_size_mlp=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=8,
                  moe_layers="0,2,3", no_rope_layers="1,3", attention_chunk_size=16,
                  floor_scale=8, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2),
    # Llama-4-Scout-17B-16E (109B, 17B active): every layer 16 experts, llama3 rope x16,
    # 10M context. Written from knowledge of its config.json (no hub access here).
    "llama4_scout": dict(_LLAMA4, num_hidden_layers=48, num_local_experts=16,
                         moe_layers=_every(1, 48, 0), max_position_embeddings=10485760,
                         rope_scaling_type="llama3", rope_scaling_factor=16.0,
                         rope_high_freq_factor=1.0, rope_low_freq_factor=1.0),
    # Llama-4-Maverick-17B-128E (400B, 17B active): 128 experts on every other layer, no
    # qk norm, 1M context.
    "llama4_maverick": dict(_LLAMA4, num_hidden_layers=48, num_local_experts=128,
                            moe_layers=_every(2, 48, 1), use_qk_norm=False,
                            max_position_embeddings=1048576),
}
