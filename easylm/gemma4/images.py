"""Images into Gemma 4's image inputs (easylm/models/vision.py's IMAGE_KEYS less
rope_positions), on the host.

The pixels are the checkpoint's own image processor's (transformers' Gemma4 PIL image
processor, read from preprocessor_config.json by `vision.load_image_processor`): it
resizes each image, keeping its aspect, to the largest multiple of patch x k pixels a side
within its budget of max_soft_tokens x k^2 patches, scales the pixels to [0, 1] and cuts
the image into patches row by row (padding the rest to the budget: left out here).

One image in a token row is the chat template's `<|image|>`; `expand_image_tokens`
writes it as transformers' Gemma4Processor does (`replace_image_token`): <boi>, then
`<|image|>` once per soft token (rows x cols / k^2), then <eoi>. `image_inputs` lays out
a batch's rows: each row's patches one image after another, padded to max_image_patches.
Not `AutoProcessor`: for Gemma 4 it also builds a video processor, which needs
torchvision, and an audio feature extractor.
"""

import numpy as np

from easylm.errors import UserError
from easylm.gemma4.vision import Gemma4VLConfig
from easylm.models.vision import ImageChatReader, expand_placeholders, lay_out_images


def encode_images(processor, images, config: Gemma4VLConfig) -> list[tuple[np.ndarray, tuple]]:
    """[(patches (N, E) float32, (rows, cols))] of each PIL image, its padding left out."""
    out = []
    for image in images:
        features = processor(images=[image], return_tensors="np")
        places = np.asarray(features["image_position_ids"])[0]  # (x, y); padding -1
        real = places[:, 0] >= 0
        patches = np.asarray(features["pixel_values"], np.float32)[0][real]
        if patches.shape[1] != config.patch_values():
            raise UserError(f"the image processor gives patches of {patches.shape[1]} values, "
                            f"but the model's patch takes {config.patch_values()} "
                            f"(3 x vision_patch_size^2)")
        grid = (int(places[real, 1].max()) + 1, int(places[real, 0].max()) + 1)
        k = config.vision_pooling_kernel_size
        if grid[0] % k or grid[1] % k or grid[0] * grid[1] != len(patches):
            raise UserError(f"the image processor's grid {grid} is not whole {k} x {k} blocks "
                            f"(vision_pooling_kernel_size={k})")
        out.append((patches, grid))
    return out


def tokens_of(grid: tuple, config: Gemma4VLConfig) -> int:
    """The soft tokens (image tokens) of an image of `grid` (rows, cols) patches."""
    return grid[0] * grid[1] // config.vision_pooling_kernel_size ** 2


def expand_image_tokens(ids, grids, config: Gemma4VLConfig) -> list[int]:
    """`ids` with its k-th image token written as <boi>, one image token per soft token of
    image k, <eoi>."""
    reader = Gemma4ImageChats(config, None)
    return expand_placeholders(ids, config.image_token_id, [reader.expansion(g) for g in grids])


def image_inputs(config: Gemma4VLConfig, rows, encoded, length: int) -> dict:
    """The image inputs (B, ...) of token rows `rows` (each with its image tokens
    expanded, at most `length` long) whose images `encoded` (per row, `encode_images`'
    pairs) are: each image's patches row by row."""
    def places_of(grid):
        height, width = grid
        row, col = np.divmod(np.arange(height * width), width)
        return np.stack([row, col, np.full_like(row, height), np.full_like(row, width)], -1)

    k = config.vision_pooling_kernel_size
    return lay_out_images(rows, encoded, length, max_patches=config.max_image_patches,
                          patch_values=config.patch_values(),
                          image_token_id=config.image_token_id, unit=k * k,
                          places_of=places_of, flag="--gemma4_vl.max_image_patches")


class Gemma4ImageChats(ImageChatReader):
    """Gemma 4's reader of image chats (easylm/models/vision.py's ImageChatReader), with
    the checkpoint's own image processor: an image is <boi>, one <|image|> per soft
    token, <eoi>."""

    def encode_images(self, images):
        return encode_images(self.image_processor, images, self.config)

    def expansion(self, grid):
        c = self.config
        return [c.boi_token_id] + [c.image_token_id] * tokens_of(grid, c) + [c.eoi_token_id]

    def batch_inputs(self, rows, encoded, length: int, segments=None) -> dict:
        # 1-D positions: packed chats' restart with the batch's `positions`; the model
        # keeps an image's two-way attention inside its segment (BidirectionalBlocks).
        return image_inputs(self.config, rows, encoded, length)
