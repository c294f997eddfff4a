"""Gemma 4's image-text model (easylm/gemma4/vision.py, vision_hf.py, images.py) against
transformers' Gemma4ForConditionalGeneration, saved tiny and random by transformers with
its PIL image processor: log-probabilities of a chat with one image and with two, read
through `hf::DIR` and laid out by the checkpoint's own image processor; negative twins
(another image; the soft tokens at the wrong tokens; the bidirectional mask among an
image's tokens dropped); the export that transformers reloads whole; the partition rules.

Tolerance: the log-probabilities are the end of about 110 reductions in sequence (per
text layer at most fourteen: four norms around attention and the MLP, q/k norms,
projections, scores, their weighted sum, the MLP's two, the per-layer input's two, over 6
layers; per vision layer twelve over 2; the patch embedding, the pooling, the projector's
norm and matmul), the widest over at most 256 terms (an image's patches attending to each
other, 12 x 20 = 240): fp32_rel(256, 110) relative to the largest |log-prob|.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import hf_parity
import torch
from numerics import assert_close, assert_differs, fp32_rel
from PIL import Image
from transformers import Gemma4ForConditionalGeneration, Gemma4ImageProcessorPil, Gemma4Processor

from easylm.errors import UserError
from easylm.gemma4 import images as gemma_images
from easylm.gemma4.vision_hf import FAMILY
from easylm.models import registry
from easylm.models.attention import BidirectionalBlocks, attention
from easylm.models.vision import load_image_processor
from easylm.runtime.sharding import match_partition_rules

CONFIG = FAMILY.from_preset("debug")
T = 144  # the rows' length: the longest chat below (two images, 60 + 64 image tokens) fits
REL = fp32_rel(256, 110)


def torch_model(config):
    """transformers' model of `config`, random, norms away from their init and weights
    large enough that an image moves the log-probabilities by far more than REL."""
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config.to_hf_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "layer_scalar")):
                p.normal_(1.0, 0.3)
            elif p.ndim >= 2:
                p.normal_(0.0, 0.08 if "vision" not in name else 0.2)
        model.model.vision_tower.std_bias.normal_(0.0, 0.5)
        model.model.vision_tower.std_scale.normal_(1.0, 0.3)
    return model


def picture(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3),
                                                               np.uint8))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(directory saved by transformers with its image processor, its model)."""
    directory = tmp_path_factory.mktemp("gemma4_vl") / "hf"
    model = torch_model(CONFIG)
    model.save_pretrained(directory)
    Gemma4ImageProcessorPil(patch_size=2, max_soft_tokens=70, pooling_kernel_size=2
                            ).save_pretrained(directory)
    return str(directory), model


@pytest.fixture(scope="module")
def ours(hf):
    config = FAMILY.hf.read_config(hf[0])
    return config, FAMILY.hf.read_params(hf[0], config)


@pytest.fixture(scope="module")
def forward(ours):
    return jax.jit(FAMILY.bind(ours[0]).forward)


def chat(config, n_images: int) -> list[int]:
    """A row with `n_images` images, each the chat template's one <|image|>."""
    ids = [1, 17, 40, 41]
    for k in range(n_images):
        ids += [config.image_token_id, 60 + k, 61]
    return ids + [77, 78, 79, 80]


def prepared(hf, config, pictures):
    """(ids expanded, the image processor's encodings) of a chat with `pictures`."""
    processor = load_image_processor(hf[0])
    encoded = gemma_images.encode_images(processor, pictures, config)
    ids = gemma_images.expand_image_tokens(chat(config, len(pictures)),
                                           [grid for _, grid in encoded], config)
    return ids, encoded


def our_logprobs(forward, params, config, ids, encoded, **changes):
    inputs = gemma_images.image_inputs(config, [ids], [encoded], T)
    inputs.update(changes)
    row = np.zeros((1, T), np.int32)
    row[0, :len(ids)] = ids
    logits = forward(params, jnp.asarray(row),
                     images={k: jnp.asarray(v) for k, v in inputs.items()}).logits
    logps = jax.nn.log_softmax(logits[0, :len(ids) - 1].astype(jnp.float32))
    return np.take_along_axis(np.asarray(logps), np.asarray(ids[1:])[:, None], 1)[:, 0]


def their_logprobs(model, hf, config, ids, pictures):
    """transformers' forward on its own image processor's padded patches and positions."""
    features = load_image_processor(hf[0])(images=pictures, return_tensors="pt")
    row = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=row, pixel_values=features["pixel_values"],
                       image_position_ids=features["image_position_ids"],
                       mm_token_type_ids=(row == config.image_token_id).int()).logits
    logps = torch.log_softmax(logits[0, :-1].double(), -1)
    return logps.gather(1, row[0, 1:, None])[:, 0].numpy()


def test_image_chat_logprobs_equal_transformers(hf, ours, forward):
    """One image (16 x 24 pixels, resized to 24 x 40: 12 x 20 patches, 60 soft tokens),
    then two (the second 16 x 16 patches, 64: height and width differ, so the axes cannot
    swap). One test, so that the two chats share the two compiled forwards."""
    config, params = ours
    causal = config.replace(use_bidirectional_attention="")
    causal_forward = jax.jit(FAMILY.bind(causal).forward)
    for sizes in ([(16, 24)], [(16, 24), (32, 32)]):
        pictures = [picture(k, *size) for k, size in enumerate(sizes)]
        ids, encoded = prepared(hf, config, pictures)
        assert [grid for _, grid in encoded] == [(12, 20), (16, 16)][:len(sizes)]
        expected = their_logprobs(hf[1], hf, config, ids, pictures)
        assert_close(our_logprobs(forward, params, config, ids, encoded), expected, REL)

        # Negative twins: another image; the soft tokens one token late; the
        # bidirectional mask among an image's tokens dropped (every layer causal).
        _, other = prepared(hf, config, [picture(9, *size) for size in sizes])
        assert_differs(our_logprobs(forward, params, config, ids, other), expected, REL)
        inputs = gemma_images.image_inputs(config, [ids], [encoded], T)
        late = np.roll(inputs["image_tokens"], 1, axis=1)
        assert_differs(our_logprobs(forward, params, config, ids, encoded, image_tokens=late),
                       expected, REL)
        assert_differs(our_logprobs(causal_forward, params, causal, ids, encoded), expected,
                       REL)


def test_image_tokens_are_written_as_transformers_processor_writes_them(hf, ours):
    """expand_image_tokens = Gemma4Processor.replace_image_token's text (the processor's
    own method, on the image processor's token counts), tokenized."""
    config = ours[0]
    pictures = [picture(0, 16, 24), picture(1, 32, 32)]
    ids, _ = prepared(hf, config, pictures)
    features = load_image_processor(hf[0])(images=pictures)
    names = types.SimpleNamespace(boi_token="<boi>", eoi_token="<eoi>", image_token="<img>")
    vocab = {"<boi>": config.boi_token_id, "<eoi>": config.eoi_token_id,
             "<img>": config.image_token_id}
    text = [Gemma4Processor.replace_image_token(names, features, k) for k in range(2)]
    tokens = [vocab[t] for piece in text for t in piece.replace("><", "> <").split()]
    assert [t for t in ids if t in vocab.values()] == tokens


def test_export_reloads_in_transformers_whole(hf, ours, tmp_path):
    config, params = ours
    hf_parity.check_whole_export(FAMILY, config, params, hf[1], Gemma4ForConditionalGeneration,
                                 tmp_path)


def test_config_json_and_refusals(hf, tmp_path):
    import json

    config = FAMILY.hf.read_config(hf[0])
    assert config == CONFIG.replace(max_image_patches=config.max_image_patches)
    assert registry.family_of(f"hf::{hf[0]}") == "gemma4"  # text unless asked for images
    saved = json.loads(open(f"{hf[0]}/config.json").read())
    for key, value in (("hidden_activation", "gelu"), ("use_clipped_linears", True)):
        (tmp_path / "config.json").write_text(json.dumps(
            {**saved, "vision_config": {**saved["vision_config"], key: value}}))
        with pytest.raises(UserError, match=key):
            FAMILY.hf.read_config(str(tmp_path))
    with pytest.raises(UserError, match="preprocessor_config.json"):
        load_image_processor(str(tmp_path))


def test_every_parameter_has_a_partition_rule(ours):
    """... and the config counts them all (what the planner and the run header read)."""
    config, params = ours
    assert sum(np.size(x) for x in jax.tree.leaves(params)) == config.num_parameters()
    specs = match_partition_rules(FAMILY.partition_rules(config), params)
    layer = specs["vision_tower"]["encoder"]["layers"]["0"]
    assert layer["self_attn"]["q_proj"]["linear"]["kernel"] is not None
    stray = {**params, "vision_tower": {**params["vision_tower"],
                                        "extra": {"kernel": np.zeros((2, 2))}}}
    with pytest.raises(Exception, match="no partition rule matches"):
        match_partition_rules(FAMILY.partition_rules(config), stray)


def test_bidirectional_blocks_mask_and_splash_refusal():
    """Block tokens see later ones of their block, within the window; text stays causal;
    splash refuses the mask in one line."""
    blocks = jnp.asarray([[-1, 0, 0, 0, -1, 1, 1]])
    mask = np.asarray(BidirectionalBlocks(blocks).dense(7, 7, window=2))[0]
    # the window bounds the earlier keys only (transformers' sliding_window_overlay)
    assert mask[1, 3] and not mask[3, 1] and mask[3, 2] and not mask[0, 1]
    assert mask[5, 6] and mask[6, 5] and not mask[4, 5] and not mask[3, 5]
    q = jnp.ones((1, 7, 2, 4))
    with pytest.raises(UserError, match="splash cannot take the bidirectional"):
        attention(q, q, q, BidirectionalBlocks(blocks), "splash")


def test_image_layout_refusals(hf, ours):
    config = ours[0]
    ids, encoded = prepared(hf, config, [picture(0, 16, 24), picture(1, 32, 32)])
    with pytest.raises(UserError, match="max_image_patches=400"):
        gemma_images.image_inputs(config.replace(max_image_patches=400), [ids], [encoded], T)
    with pytest.raises(UserError, match="2 image\\(s\\) given, but the text has 1"):
        gemma_images.expand_image_tokens(chat(config, 1), [g for _, g in encoded], config)

