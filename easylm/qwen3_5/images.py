"""Images into Qwen3.5's image inputs (easylm/models/vision.py's IMAGE_KEYS), on the host.

The pixels are the checkpoint's own image processor's (transformers' `AutoImageProcessor`
read from the checkpoint's preprocessor_config.json, its PIL backend: Qwen2-VL's PIL
processor, which resizes each image to a multiple of patch x merge pixels within its pixel
budget, normalises it and cuts it into patches, 2 x 2 merge blocks first). Not
`AutoProcessor`: for Qwen3.5 it also builds a video processor, which needs torchvision.

One image in a token row is the chat template's <|vision_start|><|image_pad|>
<|vision_end|>; `expand_image_tokens` repeats its <|image_pad|> once per merged patch,
as transformers' processor does. `image_inputs` then lays out a batch's rows: patches
padded to max_image_patches, the multimodal rotary's positions (transformers'
`Qwen3_5Model.get_rope_index`: text counts up one a token, an image's tokens sit on its
grid from the position it starts at, and the text after it resumes max(rows, cols) later).
"""

import numpy as np

from easylm.errors import UserError
from easylm.models.vision import (  # noqa: F401 (load_image_processor: this module's API)
    ImageChatReader,
    expand_placeholders,
    lay_out_images,
    load_image_processor,
)
from easylm.qwen3_5.vision import Qwen35VLConfig


def encode_images(processor, images, config: Qwen35VLConfig) -> list[tuple[np.ndarray, tuple]]:
    """[(patches (N, E) float32, (t, rows, cols))] of each PIL image."""
    out = []
    for image in images:
        features = processor(images=[image], return_tensors="np")
        patches = np.asarray(features["pixel_values"], np.float32)
        grid = tuple(int(g) for g in np.asarray(features["image_grid_thw"])[0])
        if patches.shape[1] != config.patch_values():
            raise UserError(f"the image processor gives patches of {patches.shape[1]} values, "
                            f"but the model's patch takes {config.patch_values()} "
                            f"(in_channels x temporal_patch_size x patch_size^2)")
        out.append((patches, grid))
    return out


def tokens_of(grid: tuple, config: Qwen35VLConfig) -> int:
    """The merged patches (image tokens) of an image of `grid` (t, rows, cols)."""
    return int(np.prod(grid)) // config.vision_spatial_merge_size ** 2


def expand_image_tokens(ids, grids, config: Qwen35VLConfig) -> list[int]:
    """`ids` with its k-th image token repeated once per merged patch of image k."""
    image = config.image_token_id
    return expand_placeholders(ids, image, [[image] * tokens_of(g, config) for g in grids])


def _patch_places(grid: tuple, merge: int) -> np.ndarray:
    """(N, 4): each patch's (row, col, rows, cols), in the processor's order (m x m
    blocks row by row, each block's patches row by row)."""
    t, rows, cols = grid
    j = np.arange(rows * cols)
    in_col, in_row = j % merge, (j // merge) % merge
    block_col = (j // merge ** 2) % (cols // merge)
    block_row = j // (merge ** 2 * (cols // merge))
    places = np.stack([block_row * merge + in_row, block_col * merge + in_col,
                       np.full_like(j, rows), np.full_like(j, cols)], axis=-1)
    return np.tile(places, (t, 1))


def rope_positions(ids, grids, config: Qwen35VLConfig, segments=None) -> np.ndarray:
    """(T, 3): each token's (time, height, width) rotary positions; restarting at 0 where
    `segments` (T,) changes (packed chats: no image spans two)."""
    m = config.vision_spatial_merge_size
    ids = np.asarray(ids)
    out = np.zeros((len(ids), 3), np.int64)
    start, i, k = 0, 0, 0
    while i < len(ids):
        if segments is not None and i and segments[i] != segments[i - 1]:
            start = 0
        if ids[i] != config.image_token_id:
            out[i] = start
            start, i = start + 1, i + 1
            continue
        t, rows, cols = grids[k]
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(rows // m), np.arange(cols // m),
                                 indexing="ij")
        n = tt.size
        out[i:i + n] = np.stack([tt, hh, ww], -1).reshape(n, 3) + start
        start, i, k = start + max(rows, cols) // m, i + n, k + 1
    return out


def image_inputs(config: Qwen35VLConfig, rows, encoded, length: int,
                 segments=None) -> dict:
    """The image inputs (B, ...) of token rows `rows` (each with its image tokens
    expanded, at most `length` long) whose images `encoded` (per row, `encode_images`'
    pairs) are; rows shorter than `length` are padded as text; with `segments` (B, length)
    each segment's rotary positions start at 0."""
    m = config.vision_spatial_merge_size
    inputs = lay_out_images(rows, encoded, length, max_patches=config.max_image_patches,
                            patch_values=config.patch_values(),
                            image_token_id=config.image_token_id, unit=m * m,
                            places_of=lambda grid: _patch_places(grid, m),
                            flag="--qwen3_5_vl.max_image_patches")
    inputs["rope_positions"] = np.zeros((len(rows), length, 3), np.int32)
    for b, (ids, images) in enumerate(zip(rows, encoded)):
        padded = list(ids[:length]) + [0] * (length - min(len(ids), length))
        inputs["rope_positions"][b] = rope_positions(
            padded, [g for _, g in images], config, None if segments is None else segments[b])
    return inputs


class Qwen35ImageChats(ImageChatReader):
    """Qwen3.5's reader of image chats (easylm/models/vision.py's ImageChatReader), with
    the checkpoint's own image processor: an image is one <|image_pad|> per merged patch."""

    def encode_images(self, images):
        return encode_images(self.image_processor, images, self.config)

    def expansion(self, grid):
        return [self.image_token_id] * tokens_of(grid, self.config)

    def batch_inputs(self, rows, encoded, length: int, segments=None) -> dict:
        return image_inputs(self.config, rows, encoded, length, segments)
