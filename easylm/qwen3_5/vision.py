"""Qwen3.5's image-text model (transformers' `Qwen3_5ForConditionalGeneration`): its vision
tower (a ViT with 2-D rotary and a learned position table resampled to each image's grid,
whose patch merger turns each 2 x 2 block of patches into one embedding of the text model's
width) beside the text model (easylm/qwen3_5/model.py), whose full-attention layers rotate
by the multimodal rotary: each rotary frequency reads one of a token's three positions
(time, height, width), as `mrope_section` deals them out (interleaved: frequency i reads
height when i % 3 == 1 and i < 3 s_h, width when i % 3 == 2 and i < 3 s_w, else time).

Parameters: the text model's as Qwen35ForCausalLM's (`model/...`, `lm_head`), the vision
tower's under `visual/` with transformers' names (`visual/blocks/<i>/attn/qkv`, ...);
`patch_embed/proj/kernel` is transformers' Conv3d (stride = kernel: one matmul per patch)
as a (C tp p p, D) kernel. The inputs are easylm/models/vision.py's image inputs, which
easylm/qwen3_5/images.py makes with the checkpoint's image processor.

Shape letters: B batch, P patches of a row, Q = P / m^2 merged patches, T positions,
D vision width, E a patch's values, R rotary dims.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from easylm.errors import UserError
from easylm.models import vision
from easylm.models.config import field
from easylm.models.hf_checkpoint import config_fields
from easylm.qwen3_5.config import MULTIMODAL, QWEN35_PRESETS, Qwen35Config, from_hf_dict
from easylm.qwen3_5.model import PARTITION_RULES as TEXT_RULES, Qwen35ForCausalLM
from easylm.runtime.sharding import BATCH_AXES

VISION_RULES = (
    (r"visual/patch_embed/proj/kernel", P(None, "mp")),
    (r"visual/pos_embed/embedding", P(None, "mp")),
    (r"visual/blocks/\d+/attn/qkv/kernel", P("fsdp", "mp")),
    (r"visual/blocks/\d+/attn/proj/kernel", P("mp", "fsdp")),
    (r"visual/blocks/\d+/mlp/linear_fc1/kernel", P("fsdp", "mp")),
    (r"visual/blocks/\d+/mlp/linear_fc2/kernel", P("mp", "fsdp")),
    (r"visual/merger/linear_fc1/kernel", P("fsdp", "mp")),
    (r"visual/merger/linear_fc2/kernel", P("mp", "fsdp")),
    (r"visual/.*(bias|scale)$", P(None)),
)
PARTITION_RULES = VISION_RULES + TEXT_RULES
# --qwen3_5_vl.train_vision -> the parameters a run leaves as they are (regexes on paths).
UNTRAINED = {"none": (r"^visual/",), "projector": (r"^visual/(?!merger/)",), "all": ()}
# ... and the kernels a LoRA run adapts for it (the patch embedding, PEFT's Conv3d, never).
LORA_TARGETS = {"none": "", "projector": r"^visual/merger/.*kernel$",
                "all": r"^visual/(blocks|merger)/.*kernel$"}
# transformers' Qwen3_5VisionConfig defaults: what it assumes for a key the file omits.
VISION_DEFAULTS = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                       patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                       in_channels=3, num_position_embeddings=2304,
                       hidden_act="gelu_pytorch_tanh")
_VISION_INTS = ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size",
                "temporal_patch_size", "spatial_merge_size", "in_channels",
                "num_position_embeddings", "out_hidden_size")
# The text model's model_type -> transformers' image-text config class and model.
HF_CLASSES = {"qwen3_5_text": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
              "qwen3_5_moe_text": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration")}


@dataclasses.dataclass(frozen=True)
class Qwen35VLConfig(Qwen35Config):
    """The text model's fields (Qwen35Config), the multimodal rotary's sections, the image
    token ids, and the vision tower's shape (transformers' Qwen3_5VisionConfig, each field
    prefixed vision_)."""

    section = "qwen3_5_vl"

    mrope_section: str = field("11,11,10", "rotary frequencies read from the time, height "
                                           "and width positions (comma-separated, dealt out "
                                           "interleaved; the rest read time)")
    image_token_id: int = field(248056, "the placeholder token an image embedding replaces")
    video_token_id: int = field(248057, "the video placeholder token (videos are not read)")
    vision_start_token_id: int = field(248053, "the token before an image's placeholders")
    vision_end_token_id: int = field(248054, "the token after an image's placeholders")
    vision_depth: int = field(27, "vision transformer blocks")
    vision_hidden_size: int = field(1152, "vision width")
    vision_intermediate_size: int = field(4304, "vision MLP width")
    vision_num_heads: int = field(16, "vision attention heads")
    vision_patch_size: int = field(16, "pixels of a patch's side")
    vision_temporal_patch_size: int = field(2, "frames of a patch (an image repeats its one)")
    vision_spatial_merge_size: int = field(2, "m: each m x m patches merge into one token")
    vision_in_channels: int = field(3, "colour channels")
    vision_num_position_embeddings: int = field(2304, "learned positions (a square grid)")
    vision_rope_theta: float = field(10_000.0, "the vision 2-D rotary's base")
    train_vision: str = field("none", "what of the vision tower a run trains: none (frozen), "
                                      "projector (the patch merger, visual/merger) or all")
    max_image_patches: int = field(1024, "patches of one row's images together: image inputs "
                                         "are padded to it (a fixed shape for the compiled "
                                         "step; a multiple of vision_spatial_merge_size^2)")

    def lora_targets(self) -> str:
        return LORA_TARGETS[self.train_vision]

    def __post_init__(self):
        super().__post_init__()
        unit = self.vision_spatial_merge_size ** 2
        side = int(round(self.vision_num_position_embeddings ** 0.5))
        checks = (
            (min(self.mrope_sections()) >= 0,
             f"mrope_section={self.mrope_section!r} must be three counts >= 0"),
            (self.model_type in HF_CLASSES,
             f"model_type={self.model_type!r}: the image-text models are "
             f"{', '.join(HF_CLASSES)}"),
            (self.vision_hidden_size % self.vision_num_heads == 0
             and (self.vision_hidden_size // self.vision_num_heads) % 4 == 0,
             f"vision_num_heads={self.vision_num_heads} must divide vision_hidden_size="
             f"{self.vision_hidden_size} into heads of a multiple of 4"),
            (side * side == self.vision_num_position_embeddings,
             f"vision_num_position_embeddings={self.vision_num_position_embeddings} must be "
             f"a square"),
            (self.train_vision in UNTRAINED,
             f"train_vision={self.train_vision!r} is not one of {', '.join(UNTRAINED)}"),
            (self.max_image_patches > 0 and self.max_image_patches % unit == 0,
             f"max_image_patches={self.max_image_patches} must be a positive multiple of "
             f"{unit} (vision_spatial_merge_size^2)"),
        )
        for ok, message in checks:
            if not ok:
                raise UserError(f"--qwen3_5_vl.{message}")

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json") -> "Qwen35VLConfig":
        """config.json of an image-text Qwen3.5 (`qwen3_5`, `qwen3_5_moe`)."""
        if hf.get("model_type") not in MULTIMODAL:
            raise UserError(f"{path}: model_type {hf.get('model_type')!r} is not an "
                            f"image-text Qwen3.5 ({', '.join(MULTIMODAL)}); --family=qwen3_5 "
                            f"reads text models")
        text = from_hf_dict(hf, path)
        vision = hf.get("vision_config") or {}
        if not isinstance(vision, dict):
            raise UserError(f"{path}: vision_config must be an object, got {vision!r}")
        get = config_fields(vision, f"{path} vision_config",
                            dict(VISION_DEFAULTS, out_hidden_size=text.hidden_size),
                            _VISION_INTS, {"hidden_act": "gelu_pytorch_tanh"},
                            "this Qwen3.5 vision tower")
        if get("out_hidden_size") != text.hidden_size:
            raise UserError(f"{path}: vision_config.out_hidden_size={get('out_hidden_size')} "
                            f"must be the text model's hidden_size={text.hidden_size}")
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UserError(f"{path}: vision_config.rope_parameters.rope_type="
                            f"{rope['rope_type']!r} is not supported (axial is)")
        text_rope = (hf.get("text_config") or {}).get("rope_parameters") or {}
        sections = text_rope.get("mrope_section", [11, 11, 10])
        if text_rope.get("mrope_interleaved", True) is not True:
            raise UserError(f"{path}: text_config.rope_parameters.mrope_interleaved=false is "
                            f"not supported (Qwen3.5 interleaves its sections)")
        ids = {name: hf.get(name, default) for name, default in (
            ("image_token_id", 248056), ("video_token_id", 248057),
            ("vision_start_token_id", 248053), ("vision_end_token_id", 248054))}
        return cls(
            **text.to_dict(), **ids,
            mrope_section=",".join(str(int(s)) for s in sections),
            vision_depth=get("depth"), vision_hidden_size=get("hidden_size"),
            vision_intermediate_size=get("intermediate_size"),
            vision_num_heads=get("num_heads"),
            vision_patch_size=get("patch_size"),
            vision_temporal_patch_size=get("temporal_patch_size"),
            vision_spatial_merge_size=get("spatial_merge_size"),
            vision_in_channels=get("in_channels"),
            vision_num_position_embeddings=get("num_position_embeddings"),
            vision_rope_theta=float(rope.get("rope_theta", 10_000.0)))

    def mrope_sections(self) -> tuple[int, ...]:
        try:
            sections = tuple(int(s) for s in self.mrope_section.split(","))
        except ValueError:
            sections = ()
        if len(sections) != 3:
            raise UserError(f"--qwen3_5_vl.mrope_section={self.mrope_section!r} needs three "
                            f"comma-separated integers (time, height, width)")
        return sections

    def patch_values(self) -> int:
        """E: the values of one patch (channels x frames x pixels)."""
        return (self.vision_in_channels * self.vision_temporal_patch_size
                * self.vision_patch_size ** 2)

    def vision_parameters(self) -> int:
        """The vision tower's parameters (the planner's and the run header's count)."""
        d, f, m2 = self.vision_hidden_size, self.vision_intermediate_size, \
            self.vision_spatial_merge_size ** 2
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (2 * d * f + f + d)
        merger = 2 * d + (m2 * d) ** 2 + m2 * d + m2 * d * self.hidden_size + self.hidden_size
        return (self.patch_values() * d + d + self.vision_num_position_embeddings * d
                + self.vision_depth * block + merger)

    def num_parameters(self) -> int:
        return super().num_parameters() + self.vision_parameters()

    def image_budget(self) -> tuple[int, int]:
        return self.max_image_patches, self.max_image_patches // self.vision_spatial_merge_size ** 2

    def to_hf_config(self):
        """transformers' Qwen3_5Config (or Qwen3_5MoeConfig): the text model's config as
        Qwen35Config writes it, with the multimodal rotary's sections, and the vision
        tower's."""
        import transformers

        text = super().to_hf_config().to_dict()
        text["rope_parameters"]["mrope_section"] = list(self.mrope_sections())
        text["rope_parameters"]["mrope_interleaved"] = True
        class_name, architecture = HF_CLASSES[self.model_type]
        config = getattr(transformers, class_name)(
            text_config=text, vision_config=dict(
                depth=self.vision_depth, hidden_size=self.vision_hidden_size,
                intermediate_size=self.vision_intermediate_size,
                num_heads=self.vision_num_heads, patch_size=self.vision_patch_size,
                temporal_patch_size=self.vision_temporal_patch_size,
                spatial_merge_size=self.vision_spatial_merge_size,
                in_channels=self.vision_in_channels, out_hidden_size=self.hidden_size,
                num_position_embeddings=self.vision_num_position_embeddings,
                hidden_act="gelu_pytorch_tanh", initializer_range=self.initializer_range,
                rope_parameters={"rope_type": "axial", "rope_theta": self.vision_rope_theta}),
            image_token_id=self.image_token_id, video_token_id=self.video_token_id,
            vision_start_token_id=self.vision_start_token_id,
            vision_end_token_id=self.vision_end_token_id,
            tie_word_embeddings=self.tie_word_embeddings)
        config.architectures = [architecture]
        return config


def mrope_axes(config: Qwen35VLConfig) -> np.ndarray:
    """(R/2,): which position (0 time, 1 height, 2 width) each rotary frequency reads."""
    _, height, width = config.mrope_sections()
    i = np.arange(config.rotary_dim() // 2)
    return np.where((i % 3 == 1) & (i < 3 * height), 1,
                    np.where((i % 3 == 2) & (i < 3 * width), 2, 0)).astype(np.int32)


class _TowerPart(nn.Module):
    """A part of the vision tower: its config, dtypes, and dense layers with biases."""

    config: Qwen35VLConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    def dense(self, features, name):
        return nn.Dense(features, dtype=self.dtype, param_dtype=self.param_dtype,
                        kernel_init=nn.initializers.normal(self.config.initializer_range),
                        name=name)


class _PatchEmbed(_TowerPart):
    @nn.compact
    def __call__(self, pixels):  # (B, P, E) -> (B, P, D)
        return self.dense(self.config.vision_hidden_size, "proj")(pixels.astype(self.dtype))


class _Blocks(_TowerPart):
    @nn.compact
    def __call__(self, x, cos, sin, mask):
        c = self.config
        for i in range(c.vision_depth):
            x = vision.VisionBlock(c.vision_num_heads, c.vision_intermediate_size,
                                   lambda h: nn.gelu(h, approximate=True), self.dtype,
                                   self.param_dtype, initializer_range=c.initializer_range,
                                   name=str(i))(x, cos, sin, mask)
        return x


class _Merger(_TowerPart):
    """norm each patch, then each m x m block's patches side by side through a GELU MLP
    to the text width."""

    @nn.compact
    def __call__(self, x):  # (B, P, D) -> (B, Q, D_text)
        c = self.config
        B, P, D = x.shape
        wide = D * c.vision_spatial_merge_size ** 2
        x = nn.LayerNorm(1e-6, dtype=self.dtype, param_dtype=self.param_dtype, name="norm")(x)
        x = x.reshape(B, P * D // wide, wide)
        return self.dense(c.hidden_size, "linear_fc2")(
            nn.gelu(self.dense(wide, "linear_fc1")(x), approximate=False))


class Qwen35VisionTower(_TowerPart):
    """Image inputs -> each row's merged patch embeddings (B, Q, D_text)."""

    @nn.compact
    def __call__(self, pixel_values, patch_grid, patch_segments):
        c = self.config
        x = _PatchEmbed(c, self.dtype, self.param_dtype, name="patch_embed")(pixel_values)
        rows, cols, grid_rows, grid_cols = (patch_grid[..., i] for i in range(4))
        side = int(round(c.vision_num_position_embeddings ** 0.5))
        table = nn.Embed(c.vision_num_position_embeddings, c.vision_hidden_size,
                         dtype=self.dtype, param_dtype=self.param_dtype,
                         embedding_init=nn.initializers.normal(c.initializer_range),
                         name="pos_embed")
        indices, weights = vision.bilinear_taps(rows, cols, grid_rows, grid_cols, side)
        x = x + jnp.sum(table(indices) * weights[..., None].astype(self.dtype), axis=-2)
        cos, sin = vision.axial_rotary(rows, cols, c.vision_hidden_size // c.vision_num_heads,
                                       c.vision_rope_theta, jnp.float32)
        x = _Blocks(c, self.dtype, self.param_dtype, name="blocks")(
            x, cos, sin, vision.patch_mask(patch_segments))
        # What a run does not train gets no gradient, and costs no backward pass.
        x = jax.lax.stop_gradient(x) if c.train_vision == "projector" else x
        merged = _Merger(c, self.dtype, self.param_dtype, name="merger")(x)
        return jax.lax.stop_gradient(merged) if c.train_vision == "none" else merged


class Qwen35VLForConditionalGeneration(Qwen35ForCausalLM):
    """The text model, whose token embeddings take the vision tower's at the image tokens
    and whose rotary reads (time, height, width) positions, when `images` are given;
    without them, the text model alone (the vision tower's parameters unread).

    The cache (`init_cache`) holds the layers' and each row's `rope_delta` (B,): what its
    rotary position is ahead of its cache position after its last image (transformers'
    `rope_deltas`: an image of rows x cols merged patches takes rows x cols tokens but
    max(rows, cols) positions). A call with images and a cache (a prefill, one chunk)
    writes it; a call without images (decode, extend, a text prefill) turns at position
    p + rope_delta, as transformers' generate does."""

    @nn.compact
    def __call__(self, input_ids, positions=None, segment_ids=None, cache=None,
                 return_hidden=False, images=None, logits_at=None):
        embeddings = rope_positions = None
        if images is not None:
            merged = Qwen35VisionTower(self.config, self.dtype, self.param_dtype,
                                       name="visual")(images["pixel_values"],
                                                      images["patch_grid"],
                                                      images["patch_segments"])
            embeddings = vision.image_embeddings(merged, images["image_tokens"])
            rope_positions = images["rope_positions"]
        if cache is None:
            return self.decode(input_ids, positions, segment_ids, cache, return_hidden,
                               embeddings, rope_positions, logits_at=logits_at)
        delta = cache["rope_delta"]
        if rope_positions is None:
            rope_positions = positions + delta[:, None]
        else:  # the row's last position (padding continues its text) against its place
            delta = (rope_positions[:, -1, 0] - positions[:, -1]).astype(delta.dtype)
        out, layers = self.decode(input_ids, positions, segment_ids, cache["layers"],
                                  return_hidden, embeddings, rope_positions,
                                  logits_at=logits_at)
        return out, {"layers": layers, "rope_delta": delta}

    def init_cache(self, batch_size: int, length: int, dtype=None):
        return {"layers": super().init_cache(batch_size, length, dtype),
                "rope_delta": jnp.zeros((batch_size,), jnp.int32)}

    @classmethod
    def cache_rules(cls, config):
        return super().cache_rules(config) + ((r"(^|/)rope_delta$", P(BATCH_AXES)),)

    @classmethod
    def rotary(cls, config, kind, positions, dtype):
        if positions.ndim == 2:  # one position a token: all three alike, plain rotary
            return super().rotary(config, kind, positions, dtype)
        chosen = jnp.take(positions, jnp.asarray(mrope_axes(config)), axis=-1)  # (B, T, R/2)
        angles = chosen.astype(jnp.float32) * cls.inv_freq(config, kind)
        angles = jnp.concatenate([angles, angles], axis=-1)
        return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)

    def init_params(self, rng, seq_length: int = 8):
        """Parameters of both towers: the init sees one image of one merged patch."""
        c = self.config
        unit = c.vision_spatial_merge_size ** 2
        images = {"pixel_values": jnp.zeros((1, unit, c.patch_values()), jnp.float32),
                  "patch_grid": jnp.zeros((1, unit, 4), jnp.int32),
                  "patch_segments": jnp.ones((1, unit), jnp.int32),
                  "image_tokens": jnp.full((1, seq_length), -1, jnp.int32),
                  "rope_positions": jnp.zeros((1, seq_length, 3), jnp.int32)}
        return self.init(rng, jnp.zeros((1, seq_length), jnp.int32), images=images)["params"]


# A tiny image-text model, for tests and the commands' default: the text "debug" preset
# with half of each head rotated (4 frequencies: time, height, width, time), placeholder ids
# at the top of its 512 tokens, and a two-block vision tower of 4-pixel patches.
QWEN35_VL_PRESETS = {
    "debug": dict(QWEN35_PRESETS["debug"], partial_rotary_factor=0.5, mrope_section="2,1,1",
                  image_token_id=500, video_token_id=501, vision_start_token_id=502,
                  vision_end_token_id=503, vision_depth=2, vision_hidden_size=32,
                  vision_intermediate_size=64, vision_num_heads=2, vision_patch_size=4,
                  vision_num_position_embeddings=16, max_image_patches=64),
}
