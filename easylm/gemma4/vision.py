"""Gemma 4's image-text model (transformers' `Gemma4ForConditionalGeneration`): its vision
encoder, pooler and projector beside the text model (easylm/gemma4/model.py).

    x = input_proj(2 (pixels - 1/2)) + table[0][col] + table[1][row]     patch embedding
    per block (Gemma 4's sandwich of norms, w from 1):
        h = attention(norm_in(x))      q, k RMS-normalised per head, v without a scale,
        x = x + norm_post_attn(h)        2-D rotary: the first half of a head turns with
        x = x + norm_post_ffw(mlp(norm_pre_ffw(x)))   the column, the second with the row;
                                         scores not scaled; an image's patches see each
                                         other both ways
    pooled = mean over each k x k block of patches * sqrt(D_v)   (fp32; `standardize`:
                                         (pooled - std_bias) * std_scale)
    soft token = embedding_projection(pooled / rms(pooled))      to the text width

The soft tokens replace the embeddings of the image tokens (`<|image|>`, repeated once
per soft token between <boi> and <eoi> by the processor); their ids read as the padding
token for the per-layer inputs, as transformers replaces them. With
use_bidirectional_attention="vision" an image's tokens see each other both ways in the
sliding layers (and within the window), the full layers staying causal
(attention.BidirectionalBlocks).

Parameters: the text model's as Gemma4ForCausalLM's (`model/...`), the tower's under
`vision_tower/` and the projector's under `embed_vision/`, with transformers' names
(`vision_tower/encoder/layers/<i>/self_attn/q_proj/linear/kernel`, ...). The inputs are
easylm/models/vision.py's image inputs (no rope_positions: the text rotary is 1-D), which
easylm/gemma4/images.py makes with the checkpoint's image processor.

Shape letters: B batch, P patches of a row, Q = P / k^2 soft tokens, T positions,
D vision width, E a patch's values, N heads, K key/value heads, H head dim.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from easylm.errors import UserError
from easylm.gemma4.config import GEMMA4_PRESETS, Gemma4Config, from_hf_dict
from easylm.gemma4.model import (
    Gemma4ForCausalLM,
    RMSNorm,
    base_kind,
    gelu_tanh,
    partition_rules as text_rules,
    unscaled_norm,
)
from easylm.models import vision
from easylm.models.attention import attention
from easylm.models.config import field
from easylm.models.decoder import apply_rotary, rotary_embedding
from easylm.models.hf_checkpoint import config_fields

_LAYER = r"vision_tower/encoder/layers/\d+/"
VISION_RULES = (
    (r"vision_tower/patch_embedder/input_proj/kernel", P(None, "mp")),
    (r"vision_tower/patch_embedder/position_embedding_table", P(None, None, "mp")),
    (_LAYER + r"self_attn/(q_proj|k_proj|v_proj)/linear/kernel", P("fsdp", "mp")),
    (_LAYER + r"self_attn/o_proj/linear/kernel", P("mp", "fsdp")),
    (_LAYER + r"mlp/(gate_proj|up_proj)/linear/kernel", P("fsdp", "mp")),
    (_LAYER + r"mlp/down_proj/linear/kernel", P("mp", "fsdp")),
    (r"vision_tower/.*(weight|std_bias|std_scale)$", P(None)),
    (r"embed_vision/embedding_projection/kernel", P("fsdp", "mp")),
)
# --gemma4_vl.train_vision -> the parameters a run leaves as they are (regexes on paths):
# the projector is transformers' embed_vision (Gemma4MultimodalEmbedder).
UNTRAINED = {"none": (r"^(vision_tower|embed_vision)/",), "projector": (r"^vision_tower/",),
             "all": ()}
# ... and the kernels a LoRA run adapts for it.
LORA_TARGETS = {"none": "", "projector": r"^embed_vision/.*kernel$",
                "all": r"^(vision_tower|embed_vision)/.*kernel$"}
# transformers' Gemma4VisionConfig defaults: what it assumes for a key the file omits.
VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16,
                       num_attention_heads=12, num_key_value_heads=12, head_dim=64,
                       rms_norm_eps=1e-6, patch_size=16, pooling_kernel_size=3,
                       position_embedding_size=10240, standardize=False)
_VISION_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "patch_size", "pooling_kernel_size",
                "position_embedding_size")
_VISION_MUST_BE = {"hidden_activation": "gelu_pytorch_tanh", "use_clipped_linears": False,
                   "attention_bias": False}


@dataclasses.dataclass(frozen=True)
class Gemma4VLConfig(Gemma4Config):
    """The text model's fields (Gemma4Config), the image tokens, the bidirectional mask,
    and the vision tower's shape (transformers' Gemma4VisionConfig, each prefixed vision_)."""

    section = "gemma4_vl"

    use_bidirectional_attention: str = field("", "vision: an image's tokens see each other "
                                                 "both ways in the sliding layers; '': causal")
    image_token_id: int = field(258880, "the placeholder token a soft token replaces")
    boi_token_id: int = field(255999, "the token before an image's placeholders")
    eoi_token_id: int = field(258882, "the token after an image's placeholders")
    vision_num_hidden_layers: int = field(16, "vision encoder layers")
    vision_hidden_size: int = field(768, "vision width")
    vision_intermediate_size: int = field(3072, "vision MLP width")
    vision_num_attention_heads: int = field(12, "vision attention heads")
    vision_num_key_value_heads: int = field(12, "vision key/value heads")
    vision_head_dim: int = field(64, "vision head width (a multiple of 4)")
    vision_rms_norm_eps: float = field(1e-6, "epsilon of the vision norms and the projector's")
    vision_patch_size: int = field(16, "pixels of a patch's side")
    vision_pooling_kernel_size: int = field(3, "k: each k x k patches pool into one soft token")
    vision_position_embedding_size: int = field(10240, "rows of each axis' position table")
    vision_rope_theta: float = field(100.0, "the vision 2-D rotary's base")
    vision_standardize: bool = field(False, "soft tokens (before the projector) shifted by "
                                            "std_bias and scaled by std_scale")
    train_vision: str = field("none", "what of the vision tower a run trains: none (frozen), "
                                      "projector (embed_vision) or all")
    max_image_patches: int = field(2520, "patches of one row's images together: image inputs "
                                         "are padded to it (a fixed shape for the compiled "
                                         "step; a multiple of vision_pooling_kernel_size^2)")

    def lora_targets(self) -> str:
        return LORA_TARGETS[self.train_vision]

    def __post_init__(self):
        super().__post_init__()
        unit = self.vision_pooling_kernel_size ** 2
        checks = (
            (self.use_bidirectional_attention in ("", "vision"),
             f"use_bidirectional_attention={self.use_bidirectional_attention!r} must be "
             f"'vision' or ''"),
            (self.vision_head_dim % 4 == 0,
             f"vision_head_dim={self.vision_head_dim} must be a multiple of 4 (2-D rotary)"),
            (self.vision_num_attention_heads % self.vision_num_key_value_heads == 0,
             f"vision_num_key_value_heads={self.vision_num_key_value_heads} must divide "
             f"vision_num_attention_heads={self.vision_num_attention_heads}"),
            (self.max_image_patches > 0 and self.max_image_patches % unit == 0,
             f"max_image_patches={self.max_image_patches} must be a positive multiple of "
             f"{unit} (vision_pooling_kernel_size^2)"),
            (self.train_vision in UNTRAINED,
             f"train_vision={self.train_vision!r} is not one of {', '.join(UNTRAINED)}"),
        )
        for ok, message in checks:
            if not ok:
                raise UserError(f"--gemma4_vl.{message}")

    def patch_values(self) -> int:
        """E: the values of one patch (3 colours x pixels)."""
        return 3 * self.vision_patch_size ** 2

    def vision_parameters(self) -> int:
        """The vision tower's and the projector's parameters."""
        d, f, h = self.vision_hidden_size, self.vision_intermediate_size, self.vision_head_dim
        n, k = self.vision_num_attention_heads, self.vision_num_key_value_heads
        layer = 2 * d * n * h + 2 * d * k * h + 3 * d * f + 4 * d + 2 * h
        return (self.patch_values() * d + 2 * self.vision_position_embedding_size * d
                + self.vision_num_hidden_layers * layer + d * self.hidden_size
                + (2 * d if self.vision_standardize else 0))

    def num_parameters(self) -> int:
        return super().num_parameters() + self.vision_parameters()

    def image_budget(self) -> tuple[int, int]:
        return (self.max_image_patches,
                self.max_image_patches // self.vision_pooling_kernel_size ** 2)

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "Gemma4VLConfig":
        """A `gemma4` config.json with a vision_config (its audio tower is not read)."""
        if hf.get("model_type") != "gemma4" or not isinstance(hf.get("vision_config"), dict):
            raise UserError(f"{path}: model_type {hf.get('model_type')!r} with no vision_config "
                            f"is not an image-text Gemma 4 (gemma4 with a vision_config); "
                            f"--family=gemma4 reads text models")
        text = from_hf_dict(hf, path)
        vision = hf["vision_config"]
        get = config_fields(vision, f"{path} vision_config", VISION_DEFAULTS, _VISION_INTS,
                            _VISION_MUST_BE, "this Gemma 4 vision tower")
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UserError(f"{path}: vision_config.rope_parameters.rope_type="
                            f"{rope['rope_type']!r} is not supported (axial is)")
        bidirectional = (hf.get("text_config") or {}).get("use_bidirectional_attention")
        ids = {name: hf.get(name, default) for name, default in (
            ("image_token_id", 258880), ("boi_token_id", 255999), ("eoi_token_id", 258882))}
        return cls(**text.to_dict(), **ids, use_bidirectional_attention=bidirectional or "",
                   **{f"vision_{name}": get(name) for name in _VISION_INTS},
                   vision_rms_norm_eps=float(get("rms_norm_eps")),
                   vision_standardize=bool(get("standardize")),
                   vision_rope_theta=float(rope.get("rope_theta", 100.0)))

    def to_hf_config(self):
        """transformers' Gemma4Config (Gemma4ForConditionalGeneration): the text model's
        config as Gemma4Config writes it, the vision tower's, no audio tower."""
        import transformers

        text = super().to_hf_config().to_dict()
        text["use_bidirectional_attention"] = self.use_bidirectional_attention or None
        config = transformers.Gemma4Config(
            text_config=text, audio_config=None, vision_config=dict(
                hidden_size=self.vision_hidden_size,
                intermediate_size=self.vision_intermediate_size,
                num_hidden_layers=self.vision_num_hidden_layers,
                num_attention_heads=self.vision_num_attention_heads,
                num_key_value_heads=self.vision_num_key_value_heads,
                head_dim=self.vision_head_dim, rms_norm_eps=self.vision_rms_norm_eps,
                patch_size=self.vision_patch_size,
                pooling_kernel_size=self.vision_pooling_kernel_size,
                position_embedding_size=self.vision_position_embedding_size,
                standardize=self.vision_standardize, use_clipped_linears=False,
                hidden_activation="gelu_pytorch_tanh", initializer_range=self.initializer_range,
                rope_parameters={"rope_type": "axial", "rope_theta": self.vision_rope_theta}),
            image_token_id=self.image_token_id, boi_token_id=self.boi_token_id,
            eoi_token_id=self.eoi_token_id, tie_word_embeddings=self.tie_word_embeddings)
        config.architectures = ["Gemma4ForConditionalGeneration"]
        return config


class _TowerPart(nn.Module):
    config: Gemma4VLConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    def linear(self, features, name):
        """transformers' Gemma4ClippableLinear (not clipped): a bias-free `linear` inside."""
        return _Linear(features, self.config.initializer_range, self.dtype, self.param_dtype,
                       name=name)

    def norm(self, name):
        return RMSNorm(self.config.vision_rms_norm_eps, self.dtype, self.param_dtype, name=name)


class _Linear(nn.Module):
    features: int
    initializer_range: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features, use_bias=False, dtype=self.dtype,
                        param_dtype=self.param_dtype,
                        kernel_init=nn.initializers.normal(self.initializer_range),
                        name="linear")(x)


def rotate_2d(x, cos_col, sin_col, cos_row, sin_row):
    """x (B, P, heads, H): its first H/2 dims turned by the column's angles, the rest by
    the row's (transformers' apply_multidimensional_rope over two axes)."""
    half = x.shape[-1] // 2
    return jnp.concatenate([apply_rotary(x[..., :half], cos_col, sin_col),
                            apply_rotary(x[..., half:], cos_row, sin_row)], axis=-1)


class _EncoderLayer(_TowerPart):
    @nn.compact
    def __call__(self, x, rotary, mask):
        parts = (self.config, self.dtype, self.param_dtype)
        h = _Attention(*parts, name="self_attn")(self.norm("input_layernorm")(x), rotary, mask)
        x = x + self.norm("post_attention_layernorm")(h)
        h = _MLP(*parts, name="mlp")(self.norm("pre_feedforward_layernorm")(x))
        return x + self.norm("post_feedforward_layernorm")(h)


class _Layers(_TowerPart):
    @nn.compact
    def __call__(self, x, rotary, mask):
        for i in range(self.config.vision_num_hidden_layers):
            x = _EncoderLayer(self.config, self.dtype, self.param_dtype, name=str(i))(
                x, rotary, mask)
        return x


class _Encoder(_TowerPart):
    @nn.compact
    def __call__(self, x, rotary, mask):
        return _Layers(self.config, self.dtype, self.param_dtype, name="layers")(x, rotary, mask)


class _Attention(_TowerPart):
    @nn.compact
    def __call__(self, x, rotary, mask):
        c = self.config
        B, P, _ = x.shape
        N, K, H = c.vision_num_attention_heads, c.vision_num_key_value_heads, c.vision_head_dim
        q = self.norm("q_norm")(self.linear(N * H, "q_proj")(x).reshape(B, P, N, H))
        k = self.norm("k_norm")(self.linear(K * H, "k_proj")(x).reshape(B, P, K, H))
        v = unscaled_norm(self.linear(K * H, "v_proj")(x).reshape(B, P, K, H),
                          c.vision_rms_norm_eps)
        out = attention(rotate_2d(q, *rotary), rotate_2d(k, *rotary), v, mask, "xla",
                        scale=1.0)
        return self.linear(c.vision_hidden_size, "o_proj")(out.reshape(B, P, N * H))


class _MLP(_TowerPart):
    @nn.compact
    def __call__(self, x):
        F = self.config.vision_intermediate_size
        h = gelu_tanh(self.linear(F, "gate_proj")(x)) * self.linear(F, "up_proj")(x)
        return self.linear(self.config.vision_hidden_size, "down_proj")(h)


class _PatchEmbedder(_TowerPart):
    @nn.compact
    def __call__(self, pixels, rows, cols, valid):  # (B, P, E) -> (B, P, D)
        c = self.config
        x = self.param("position_embedding_table", nn.initializers.normal(c.initializer_range),
                       (2, c.vision_position_embedding_size, c.vision_hidden_size),
                       self.param_dtype).astype(self.dtype)
        places = x[0][cols] + x[1][rows]
        h = nn.Dense(c.vision_hidden_size, use_bias=False, dtype=self.dtype,
                     param_dtype=self.param_dtype,
                     kernel_init=nn.initializers.normal(c.initializer_range),
                     name="input_proj")(2 * (pixels.astype(self.dtype) - 0.5))
        return h + jnp.where(valid[..., None], places, 0)


def pool_targets(patch_grid, k: int):
    """(B, P) the soft token (an index into the row's Q) each patch pools into: its
    image's first soft token (the patches before the image / k^2: images lie one after
    another, each a whole number of k x k blocks, row by row) plus its block's place in
    the image's pooled grid, row by row (transformers' `_avg_pool_by_positions`)."""
    rows, cols, grid_cols = patch_grid[..., 0], patch_grid[..., 1], patch_grid[..., 3]
    index = jnp.arange(patch_grid.shape[1])[None]
    first = (index - (rows * grid_cols + cols)) // (k * k)
    return first + cols // k + (grid_cols // k) * (rows // k)


class Gemma4VisionTower(_TowerPart):
    """Image inputs -> each row's pooled patches (B, Q, D) in fp32, before the projector."""

    @nn.compact
    def __call__(self, pixel_values, patch_grid, patch_segments):
        c = self.config
        k = c.vision_pooling_kernel_size
        rows, cols = patch_grid[..., 0], patch_grid[..., 1]
        valid = patch_segments > 0
        x = _PatchEmbedder(c, self.dtype, self.param_dtype, name="patch_embedder")(
            pixel_values, rows, cols, valid)
        half = c.vision_head_dim // 2
        inv_freq = 1.0 / (c.vision_rope_theta ** (jnp.arange(0, half, 2, dtype=jnp.float32)
                                                  / half))
        rotary = (*rotary_embedding(cols, inv_freq, self.dtype),
                  *rotary_embedding(rows, inv_freq, self.dtype))
        x = _Encoder(c, self.dtype, self.param_dtype, name="encoder")(
            x, rotary, vision.patch_mask(patch_segments))
        Q = x.shape[1] // (k * k)
        targets = jnp.where(valid, pool_targets(patch_grid, k), Q)  # padding: dropped
        x = jnp.where(valid[..., None], x, 0).astype(jnp.float32) / (k * k)
        pooled = jax.vmap(lambda h, t: jax.ops.segment_sum(h, t, num_segments=Q))(x, targets)
        pooled = pooled * float(np.sqrt(c.vision_hidden_size))
        if c.vision_standardize:
            bias = self.param("std_bias", nn.initializers.zeros_init(),
                              (c.vision_hidden_size,), self.param_dtype)
            scale = self.param("std_scale", nn.initializers.ones, (c.vision_hidden_size,),
                               self.param_dtype)
            pooled = (pooled - bias.astype(jnp.float32)) * scale.astype(jnp.float32)
        return pooled.astype(self.dtype)


class _Projector(_TowerPart):
    @nn.compact
    def __call__(self, pooled):  # (B, Q, D) -> (B, Q, D_text)
        c = self.config
        return nn.Dense(c.hidden_size, use_bias=False, dtype=self.dtype,
                        param_dtype=self.param_dtype,
                        kernel_init=nn.initializers.normal(c.initializer_range),
                        name="embedding_projection")(
            unscaled_norm(pooled, c.vision_rms_norm_eps))


class Gemma4VLForConditionalGeneration(Gemma4ForCausalLM):
    """The text model whose image tokens take the vision tower's soft tokens when
    `images` are given (and, with use_bidirectional_attention="vision", see each other
    both ways in the sliding layers); without them, the text model alone."""

    @nn.compact
    def __call__(self, input_ids, positions=None, segment_ids=None, cache=None,
                 return_hidden=False, images=None, logits_at=None):
        c = self.config
        embeddings = blocks = None
        if images is not None:
            pooled = Gemma4VisionTower(c, self.dtype, self.param_dtype, name="vision_tower")(
                images["pixel_values"], images["patch_grid"], images["patch_segments"])
            # What a run does not train gets no gradient, and costs no backward pass.
            pooled = jax.lax.stop_gradient(pooled) if c.train_vision != "all" else pooled
            merged = _Projector(c, self.dtype, self.param_dtype, name="embed_vision")(pooled)
            merged = jax.lax.stop_gradient(merged) if c.train_vision == "none" else merged
            embeddings = vision.image_embeddings(merged, images["image_tokens"])
            blocks = vision.image_blocks(images["image_tokens"])
        # The per-layer inputs read an image token as the padding token, as transformers.
        input_ids = jnp.where(input_ids == c.image_token_id, c.pad_token_id or 0, input_ids)
        out = self.decode(input_ids, positions, segment_ids, cache, return_hidden,
                          embeddings, blocks=blocks, logits_at=logits_at)
        return self.soft_cap(out, cache, return_hidden)

    @classmethod
    def bidirectional(cls, config, kind):
        return config.use_bidirectional_attention == "vision" and \
            base_kind(kind) == "sliding_attention"

    def init_params(self, rng, seq_length: int = 8):
        """Parameters of both towers: the init sees one image of one soft token."""
        c = self.config
        unit = c.vision_pooling_kernel_size ** 2
        images = {"pixel_values": jnp.zeros((1, unit, c.patch_values()), jnp.float32),
                  "patch_grid": jnp.zeros((1, unit, 4), jnp.int32),
                  "patch_segments": jnp.ones((1, unit), jnp.int32),
                  "image_tokens": jnp.full((1, seq_length), -1, jnp.int32)}
        return self.init(rng, jnp.zeros((1, seq_length), jnp.int32), images=images)["params"]


def partition_rules(config: Gemma4VLConfig):
    return VISION_RULES + text_rules(config)


# A tiny image-text model, for tests and the commands' default: the text "debug" preset
# (its window of 8 shorter than an image's tokens), image ids at the top of its 512
# tokens, the bidirectional mask, and a two-layer vision tower of 2-pixel patches pooled
# 2 x 2.
GEMMA4_VL_PRESETS = {
    "debug": dict(GEMMA4_PRESETS["debug"], use_bidirectional_attention="vision",
                  image_token_id=500, boi_token_id=501, eoi_token_id=502,
                  vision_num_hidden_layers=2, vision_hidden_size=32,
                  vision_intermediate_size=64, vision_num_attention_heads=2,
                  vision_num_key_value_heads=2, vision_head_dim=16, vision_patch_size=2,
                  vision_pooling_kernel_size=2, vision_position_embedding_size=64,
                  vision_standardize=True, max_image_patches=560),
}
