"""What image-text models share: the image inputs a batch carries, at fixed shapes; a
vision transformer block with 2-D rotary; the image's embeddings put in place of its
placeholder tokens' before the decoder's layers, and its tokens' blocks for the attention
that lets them see each other (`image_blocks`); the checkpoint's image processor.

The image inputs (`IMAGE_KEYS`, (B, ...) arrays beside the tokens, made on the host by a
family's processor from the checkpoint's own image processor):

    pixel_values     (B, P, E)  each row's patches, its images one after another, then
                                zeros up to P (a config's max_image_patches)
    patch_grid       (B, P, 4)  each patch's (row, column) in its image's patch grid, and
                                that grid's (rows, columns); zeros for padding
    patch_segments   (B, P)     which image of the row a patch is in (1, 2, ...; 0: padding):
                                a patch attends to its own image's only
    image_tokens     (B, T)     for each token, the merged patch (an index into the row's
                                vision tower outputs) whose embedding replaces it; -1: none
    rope_positions   (B, T, A)  a token's rotary positions over A axes (time, height,
                                width for Qwen3.5's multimodal rotary; a family with 1-D
                                positions, Gemma 4, has none)

Shape letters: B batch, P patches of a row, Q merged patches, T positions, D width,
E a patch's values (channels x frames x pixels), N heads, H head dim.
"""

import abc
import hashlib
import os
from typing import Callable

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from easylm.errors import UserError
from easylm.models.attention import attention
from easylm.models.decoder import apply_rotary

IMAGE_KEYS = ("pixel_values", "patch_grid", "patch_segments", "image_tokens", "rope_positions")
# The keys whose second axis is the row's tokens (T): a row laid out for T tokens holds
# those of any shorter length as its first ones (the serving engine cuts a request's to
# its length bucket).
TOKEN_KEYS = ("image_tokens", "rope_positions")


def axial_rotary(rows, cols, head_dim: int, theta: float, dtype):
    """cos, sin (B, P, H) of 2-D rotary at patch (rows, cols) (B, P): the first half of a
    head's frequencies turn with the row, the second with the column (each H/4 frequencies
    of base `theta` over H/2 dims), laid out for rotate-half like 1-D rotary."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half))
    angles = jnp.concatenate([rows[..., None].astype(jnp.float32) * inv_freq,
                              cols[..., None].astype(jnp.float32) * inv_freq], axis=-1)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def bilinear_taps(rows, cols, grid_rows, grid_cols, side: int):
    """(indices, weights) (B, P, 4) into a (side x side) table of learned position
    embeddings, resampled to each image's grid bilinearly with aligned corners (as
    torch's F.interpolate(align_corners=True) does): the four neighbours of (rows, cols)
    (B, P) in an image of (grid_rows, grid_cols) patches."""
    def axis(index, size):  # (taps (..., 2), weights (..., 2)) along one axis
        src = index.astype(jnp.float32) * (side - 1) / jnp.maximum(size - 1, 1)
        floor = jnp.floor(src)
        raw = floor[..., None] + jnp.arange(2, dtype=jnp.float32)
        weights = jnp.maximum(1.0 - jnp.abs(src[..., None] - raw), 0.0)
        return jnp.clip(raw, 0, side - 1).astype(jnp.int32), weights

    h_taps, h_weights = axis(rows, grid_rows)
    w_taps, w_weights = axis(cols, grid_cols)
    indices = h_taps[..., :, None] * side + w_taps[..., None, :]
    weights = h_weights[..., :, None] * w_weights[..., None, :]
    return indices.reshape(*rows.shape, 4), weights.reshape(*rows.shape, 4)


def image_embeddings(merged, image_tokens):
    """(values (B, T, D), where (B, T)): each token's embedding from `merged` (B, Q, D)
    where `image_tokens` (B, T) names one, what `CausalLM.decode` puts in place of the
    token embedding."""
    where = image_tokens >= 0
    values = jnp.take_along_axis(merged, jnp.maximum(image_tokens, 0)[..., None], axis=1)
    return values, where


class _Part(nn.Module):
    """Dense layers with biases, as a vision block's parts make them."""

    dtype: jnp.dtype
    param_dtype: jnp.dtype
    initializer_range: float

    def dense(self, features, name):
        return nn.Dense(features, dtype=self.dtype, param_dtype=self.param_dtype,
                        kernel_init=nn.initializers.normal(self.initializer_range), name=name)


class VisionAttention(_Part):
    """qkv (D, 3 N H: queries, keys, values), 2-D rotary on whole heads (in fp32, as
    transformers' apply_rotary_pos_emb_vision), attention under `mask`, proj."""

    num_heads: int = 1

    @nn.compact
    def __call__(self, x, cos, sin, mask):
        B, P, D = x.shape
        N = self.num_heads
        qkv = self.dense(3 * D, "qkv")(x).reshape(B, P, 3, N, D // N)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q = apply_rotary(q.astype(jnp.float32), cos, sin).astype(self.dtype)
        k = apply_rotary(k.astype(jnp.float32), cos, sin).astype(self.dtype)
        return self.dense(D, "proj")(attention(q, k, v, mask, "xla").reshape(B, P, D))


class VisionMLP(_Part):
    """linear_fc2(activation(linear_fc1(x)))."""

    intermediate_size: int = 0
    activation: Callable = nn.gelu

    @nn.compact
    def __call__(self, x):
        h = self.activation(self.dense(self.intermediate_size, "linear_fc1")(x))
        return self.dense(x.shape[-1], "linear_fc2")(h)


class VisionBlock(nn.Module):
    """A pre-norm vision transformer block, x + attn(norm1(x)), then x + mlp(norm2(x)),
    with layer norms. Parameter names are transformers' Qwen-VL vision blocks' (norm1,
    attn/qkv, attn/proj, mlp/linear_fc1, ...)."""

    num_heads: int
    intermediate_size: int
    activation: Callable
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    eps: float = 1e-6
    initializer_range: float = 0.02

    @nn.compact
    def __call__(self, x, cos, sin, mask):
        parts = dict(dtype=self.dtype, param_dtype=self.param_dtype,
                     initializer_range=self.initializer_range)
        norm = lambda name: nn.LayerNorm(self.eps, dtype=self.dtype,
                                         param_dtype=self.param_dtype, name=name)
        x = x + VisionAttention(**parts, num_heads=self.num_heads, name="attn")(
            norm("norm1")(x), cos, sin, mask)
        return x + VisionMLP(**parts, intermediate_size=self.intermediate_size,
                             activation=self.activation, name="mlp")(norm("norm2")(x))


def patch_mask(segments):
    """(B, P, P): patches of one image attend to each other (padding to padding, which
    keeps every softmax row finite; nothing reads those)."""
    return segments[:, :, None] == segments[:, None, :]


def image_blocks(image_tokens):
    """(B, T) each token's block: runs of image tokens numbered 0, 1, ... in a row, -1 for
    text (transformers' `get_block_sequence_ids_for_mask`): what
    attention.BidirectionalBlocks reads."""
    is_image = image_tokens >= 0
    before = jnp.pad(is_image[:, :-1], ((0, 0), (1, 0)))
    starts = is_image & ~before
    return jnp.where(is_image, jnp.cumsum(starts, axis=1) - 1, -1)


def image_inputs_of(batch: dict) -> dict | None:
    """A batch's image inputs (those of IMAGE_KEYS it has), or None for a batch of text."""
    if "pixel_values" not in batch:
        return None
    return {key: batch[key] for key in IMAGE_KEYS if key in batch}


def stack_rows(rows: list[dict], count: int, length: int) -> dict:
    """One (count, ...) image input of `rows` (each a (1, ...) image input whose token keys
    are at least `length` long), their token keys cut to `length`, padded with rows of no
    image (image_tokens -1, the rest zeros)."""
    out = {}
    for key in rows[0]:
        parts = [row[key][:, :length] if key in TOKEN_KEYS else row[key] for row in rows]
        blank = np.full_like(parts[0], -1 if key == "image_tokens" else 0)
        out[key] = np.concatenate(parts + [blank] * (count - len(rows)))
    return out


def images_key(encoded) -> str:
    """The identity of a prompt's images `encoded` ([(patches, grid)]) for the serving
    engine's prompt sharing (`PromptImages.keys`): the sha256 of their grids and patches,
    what the image processor made of the images' bytes. Prompts of equal tokens share a
    prefill and pages only with equal keys: an image's placeholder tokens are the same
    whatever the image."""
    digest = hashlib.sha256()
    for patches, grid in encoded:
        digest.update(np.asarray(grid, np.int64).tobytes())
        digest.update(np.ascontiguousarray(patches, np.float32).tobytes())
    return digest.hexdigest()


def processor_directory(tokenizer: str, load_checkpoint: str) -> str:
    """Where an image-text model's image processor is saved (preprocessor_config.json):
    beside the --tokenizer directory, else in --load_checkpoint's hf::DIR."""
    if not os.path.isfile(os.path.join(tokenizer, "preprocessor_config.json")) \
            and load_checkpoint.startswith("hf::"):
        return load_checkpoint[len("hf::"):]
    return tokenizer


def load_image_processor(directory: str):
    """The image processor DIR/preprocessor_config.json describes (its PIL class: the
    fast ones need torchvision)."""
    if not os.path.isfile(os.path.join(directory, "preprocessor_config.json")):
        raise UserError(f"{directory}: no preprocessor_config.json: the image processor "
                        f"the checkpoint was trained with is needed to read images")
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(directory, **pil_backend())


def pil_backend() -> dict:
    """from_pretrained's keyword for the PIL class: `backend="pil"` where transformers has
    named backends (its image_processing_backends; `use_fast` is then deprecated: a
    warning on stderr at a process's first load), `use_fast=False` before."""
    import importlib.util

    return {"backend": "pil"} if importlib.util.find_spec(
        "transformers.image_processing_backends") else {"use_fast": False}


def expand_placeholders(ids, placeholder: int, expansions) -> list[int]:
    """`ids` with its k-th `placeholder` token replaced by the tokens `expansions[k]`
    (what the processor writes for image k); the counts must agree."""
    out, k = [], 0
    for token in ids:
        if token != placeholder:
            out.append(token)
            continue
        if k == len(expansions):
            raise UserError(f"the text has more image placeholders than the "
                            f"{len(expansions)} image(s) given")
        out.extend(expansions[k])
        k += 1
    if k != len(expansions):
        raise UserError(f"{len(expansions)} image(s) given, but the text has {k} image "
                        f"placeholder(s)")
    return out


def lay_out_images(rows, encoded, length: int, *, max_patches: int, patch_values: int,
                   image_token_id: int, unit: int, places_of: Callable, flag: str) -> dict:
    """The image inputs (B, ...) but rope_positions, on the host, of token rows `rows`
    (each with its image tokens expanded, at most `length` long) whose images `encoded`
    are (per row, [(patches (n, E), grid)]): each row's patches one image after another,
    padded to `max_patches` (the flag `flag` names), `places_of(grid)` (n, 4) their
    patch_grid rows, `unit` patches an image token; the k-th image token of a row takes
    the row's k-th token of the vision tower's output."""
    B, P = len(rows), max_patches
    inputs = {"pixel_values": np.zeros((B, P, patch_values), np.float32),
              "patch_grid": np.zeros((B, P, 4), np.int32),
              "patch_segments": np.zeros((B, P), np.int32),
              "image_tokens": np.full((B, length), -1, np.int32)}
    for b, (ids, images) in enumerate(zip(rows, encoded)):
        total = sum(len(patches) for patches, _ in images)
        if total > P:
            raise UserError(f"row {b}: its {len(images)} image(s) have {total} patches, more "
                            f"than {flag}={P}")
        places = np.flatnonzero(np.asarray(ids) == image_token_id)
        if len(places) != total // unit:
            raise UserError(f"row {b}: {len(places)} image tokens for the {total // unit} "
                            f"its {len(images)} image(s) make")
        if len(places) and places[-1] >= length:
            raise UserError(f"row {b}: an image's tokens run past the row's {length} tokens")
        at = 0
        for segment, (patches, grid) in enumerate(images, start=1):
            n = len(patches)
            inputs["pixel_values"][b, at:at + n] = patches
            inputs["patch_grid"][b, at:at + n] = places_of(grid)
            inputs["patch_segments"][b, at:at + n] = segment
            at += n
        inputs["image_tokens"][b, places] = np.arange(len(places))
    return inputs


class ImageChatReader(abc.ABC):
    """What the data pipeline asks of an image-text model (easylm/data/image_chats.py): a
    chat with image parts as token ids, loss masks and the images' encodings
    (`encode_chat`), and a batch's image inputs (`batch_inputs`). A family's reader (its
    images.py) says how its image processor's output becomes patches and a grid
    (`encode_images`), what the processor writes for one image's placeholder
    (`expansion`), and how a batch's rows are laid out (`batch_inputs`)."""

    def __init__(self, config, image_processor):
        self.config, self.image_processor = config, image_processor
        self.image_token_id = config.image_token_id

    @abc.abstractmethod
    def encode_images(self, images) -> list[tuple[np.ndarray, tuple]]:
        """[(patches (N, E) float32, grid)] of each PIL image."""

    @abc.abstractmethod
    def expansion(self, grid: tuple) -> list[int]:
        """The tokens that stand for one image of `grid` in a token row."""

    @abc.abstractmethod
    def batch_inputs(self, rows, encoded, length: int, segments=None) -> dict:
        """The image inputs (B, ...) of token rows `rows` (each with its image tokens
        expanded, at most `length` long) whose images `encoded` (per row) are; `segments`
        (B, length): the chats of packed rows (image_chats.py), where a family's own
        positions restart."""

    def image_tokens(self, grid: tuple) -> int:
        """The image tokens (embeddings from the vision tower) of an image of `grid`."""
        return self.expansion(grid).count(self.image_token_id)

    def encode_chat(self, text_processor, messages, images, where: str, first: int = 0):
        """(ids, loss masks, the images' encodings) of one chat whose messages may hold
        image parts (easylm/data/images.py), rendered by the chat template
        (`text_processor`, a TextProcessor in chat mode: loss on the assistant's tokens
        from message `first` on, e.g. a preference pair's replies), each image's
        placeholder written as the processor writes it (`expansion`), with no loss.
        `images`: the PIL images of the messages' image parts, in order (the data
        pipeline reads them: easylm/data/images.py's `chat_images`)."""
        encoded = self.encode_images(images)
        result = text_processor.encode_chats([(messages, first, where)], parts=True)[0]
        if isinstance(result, str):  # a row with nothing to train on: its reason
            raise UserError(result)
        ids, masks = result
        places = np.flatnonzero(ids == self.image_token_id)
        if len(places) != len(encoded):
            raise UserError(f"{where}: the chat template wrote {len(places)} image "
                            f"placeholder(s) for the {len(encoded)} image part(s)")
        pieces_ids, pieces_masks, at = [], [], 0
        for place, (_, grid) in zip(places, encoded):
            tokens = self.expansion(grid)
            pieces_ids += [ids[at:place], np.asarray(tokens, ids.dtype)]
            pieces_masks += [masks[at:place], np.zeros(len(tokens), masks.dtype)]
            at = place + 1
        pieces_ids.append(ids[at:])
        pieces_masks.append(masks[at:])
        return np.concatenate(pieces_ids), np.concatenate(pieces_masks), encoded

    def encode_prompt(self, ids, images, where: str):
        """(ids with each image's placeholder written as the processor writes it, the
        images' encodings) of a prompt rendered to `ids` whose placeholders stand for
        `images` (PIL, in order): a rollout's prompt (easylm/data/prompts.py)."""
        ids = np.asarray(ids)
        encoded = self.encode_images(images)
        places = np.flatnonzero(ids == self.image_token_id)
        if len(places) != len(encoded):
            raise UserError(f"{where}: the chat template wrote {len(places)} image "
                            f"placeholder(s) for the {len(encoded)} image part(s)")
        pieces, at = [], 0
        for place, (_, grid) in zip(places, encoded):
            pieces += [ids[at:place], np.asarray(self.expansion(grid), ids.dtype)]
            at = place + 1
        pieces.append(ids[at:])
        return np.concatenate(pieces).astype(np.int32), encoded
