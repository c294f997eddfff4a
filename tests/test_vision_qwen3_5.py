"""Qwen3.5's image-text model (easylm/qwen3_5/vision.py, vision_hf.py, images.py) against
transformers' Qwen3_5ForConditionalGeneration, saved tiny and random by transformers with
its PIL image processor: log-probabilities of a chat with one image and with two, read
through `hf::DIR` and laid out by the checkpoint's own image processor; negative twins
(another image; the image's embeddings at the wrong tokens; plain 1-D rotary positions);
the export that transformers reloads whole; the partition rules.

Tolerance: the log-probabilities are the end of about 70 reductions in sequence (per text
layer at most twelve, tests/test_qwen3_5.py; per vision block eight: qkv, scores, their
weighted sum, proj, two norms, the MLP's two; the patch embedding, the position table's
four taps and the merger's norm and two layers), the widest over 128 terms (the merger's
4 x 32 inputs, the MLP's 128): fp32_rel(128, 70) relative to the largest |log-prob|.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import hf_parity
import torch
from numerics import assert_close, assert_differs, fp32_rel
from PIL import Image
from transformers import (
    AutoImageProcessor,
    Qwen2VLImageProcessorPil,
    Qwen3_5ForConditionalGeneration,
)

from easylm.data.images import chat_images
from easylm.errors import UserError
from easylm.models import registry
from easylm.models.vision import pil_backend
from easylm.qwen3_5 import images as qwen_images
from easylm.qwen3_5.vision_hf import FAMILY
from easylm.runtime.sharding import match_partition_rules

CONFIG = FAMILY.from_preset("debug")
T = 48  # the rows' length: the longest chat below (two images, 14 image tokens) fits
REL = fp32_rel(128, 70)


def torch_model(config):
    """transformers' model of `config`, random, norms away from their init and weights
    large enough that an image moves the log-probabilities by far more than REL."""
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config.to_hf_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 0.1).log())
            elif name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "dt_bias")):
                p.normal_(0.0 if "visual" not in name else 1.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            elif p.ndim >= 2:
                p.normal_(0.0, 0.08)
    return model


def picture(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3),
                                                               np.uint8))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(directory saved by transformers with its image processor, its model)."""
    directory = tmp_path_factory.mktemp("qwen3_5_vl") / "hf"
    model = torch_model(CONFIG)
    model.save_pretrained(directory)
    Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                             size={"shortest_edge": 64, "longest_edge": 1024}
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
    """A row with `n_images` images, each <|vision_start|><|image_pad|><|vision_end|>."""
    ids = [1, 17, 40, 41]
    for k in range(n_images):
        ids += [config.vision_start_token_id, config.image_token_id,
                config.vision_end_token_id, 60 + k, 61]
    return ids + [77, 78, 79, 80]


def prepared(hf, config, pictures):
    """(ids expanded, the image processor's encodings) of a chat with `pictures`."""
    processor = qwen_images.load_image_processor(hf[0])
    encoded = qwen_images.encode_images(processor, pictures, config)
    ids = qwen_images.expand_image_tokens(chat(config, len(pictures)),
                                          [grid for _, grid in encoded], config)
    return ids, encoded


def our_logprobs(forward, params, config, ids, encoded, **changes):
    inputs = qwen_images.image_inputs(config, [ids], [encoded], T)
    inputs.update(changes)
    row = np.zeros((1, T), np.int32)
    row[0, :len(ids)] = ids
    logits = forward(params, jnp.asarray(row),
                     images={k: jnp.asarray(v) for k, v in inputs.items()}).logits
    logps = jax.nn.log_softmax(logits[0, :len(ids) - 1].astype(jnp.float32))
    return np.take_along_axis(np.asarray(logps), np.asarray(ids[1:])[:, None], 1)[:, 0]


def their_logprobs(model, config, ids, encoded):
    pixels = torch.from_numpy(np.concatenate([p for p, _ in encoded]))
    grids = torch.tensor([grid for _, grid in encoded])
    row = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=row, pixel_values=pixels, image_grid_thw=grids,
                       mm_token_type_ids=(row == config.image_token_id).int()).logits
    logps = torch.log_softmax(logits[0, :-1].double(), -1)
    return logps.gather(1, row[0, 1:, None])[:, 0].numpy()


@pytest.mark.parametrize("sizes", [[(24, 16)], [(24, 16), (16, 32)]])
def test_image_chat_logprobs_equal_transformers(hf, ours, forward, sizes):
    """One image (24 x 16 pixels: 6 x 4 patches, 6 tokens), then two (the second 4 x 8
    patches, 8 tokens: height and width differ, so the rotary's axes cannot swap)."""
    config, params = ours
    pictures = [picture(k, *size) for k, size in enumerate(sizes)]
    ids, encoded = prepared(hf, config, pictures)
    assert [grid for _, grid in encoded] == [(1, 6, 4), (1, 4, 8)][:len(sizes)]
    expected = their_logprobs(hf[1], config, ids, encoded)
    assert_close(our_logprobs(forward, params, config, ids, encoded), expected, REL)

    # Negative twins: another image; the image's embeddings one token late; the rotary
    # at plain text positions.
    _, other = prepared(hf, config, [picture(9, *size) for size in sizes])
    assert_differs(our_logprobs(forward, params, config, ids, other), expected, REL)
    inputs = qwen_images.image_inputs(config, [ids], [encoded], T)
    late = np.roll(inputs["image_tokens"], 1, axis=1)
    assert_differs(our_logprobs(forward, params, config, ids, encoded, image_tokens=late),
                   expected, REL)
    flat = np.broadcast_to(np.arange(T)[None, :, None], (1, T, 3)).astype(np.int32)
    assert_differs(our_logprobs(forward, params, config, ids, encoded, rope_positions=flat),
                   expected, REL)


def test_the_checkpoints_own_image_processor_is_read(hf):
    processor = AutoImageProcessor.from_pretrained(hf[0], **pil_backend())
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    assert type(qwen_images.load_image_processor(hf[0])) is type(processor)


def test_export_reloads_in_transformers_whole(hf, ours, tmp_path):
    config, params = ours
    hf_parity.check_whole_export(FAMILY, config, params, hf[1], Qwen3_5ForConditionalGeneration,
                                 tmp_path)


def test_config_json_and_refusals(hf, tmp_path):
    config = FAMILY.hf.read_config(hf[0])
    assert config == CONFIG.replace(max_image_patches=config.max_image_patches)
    assert registry.family_of(f"hf::{hf[0]}") == "qwen3_5"  # text unless asked for images
    saved = json.loads(open(f"{hf[0]}/config.json").read())
    for key, value in (("hidden_act", "gelu"), ("out_hidden_size", 32)):
        (tmp_path / "config.json").write_text(json.dumps(
            {**saved, "vision_config": {**saved["vision_config"], key: value}}))
        with pytest.raises(UserError, match=key):
            FAMILY.hf.read_config(str(tmp_path))
    with pytest.raises(UserError, match="preprocessor_config.json"):
        qwen_images.load_image_processor(str(tmp_path))


def test_every_parameter_has_a_partition_rule(ours):
    config, params = ours
    specs = match_partition_rules(FAMILY.partition_rules(config), params)
    assert specs["visual"]["blocks"]["0"]["attn"]["qkv"]["kernel"] is not None
    stray = {**params, "visual": {**params["visual"], "extra": {"kernel": np.zeros((2, 2))}}}
    with pytest.raises(Exception, match="no partition rule matches"):
        match_partition_rules(FAMILY.partition_rules(config), stray)


def test_image_layout_refusals(hf, ours):
    config = ours[0]
    ids, encoded = prepared(hf, config, [picture(0, 24, 16), picture(1, 16, 32)])
    with pytest.raises(UserError, match="max_image_patches=48"):
        qwen_images.image_inputs(config.replace(max_image_patches=48), [ids], [encoded], T)
    with pytest.raises(UserError, match="2 image\\(s\\) given, but the text has 1"):
        qwen_images.expand_image_tokens(chat(config, 1), [g for _, g in encoded], config)


# Qwen3.5's chat template in small: an image part is <|vision_start|><|image_pad|>
# <|vision_end|>, text parts follow; words are the vocabulary's w0 ... w499.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}"
    "{{ p['text'] }} {% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def vl_tokenizer(config):
    """A word-level tokenizer whose placeholders have the checkpoint's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<|image_pad|>": config.image_token_id, "<|video_pad|>": config.video_token_id,
                "<|vision_start|>": config.vision_start_token_id,
                "<|vision_end|>": config.vision_end_token_id, "<|im_start|>": 504,
                "<|im_end|>": 505}
    vocab = {f"w{i}": i for i in range(500)} | specials | {"user": 506, "assistant": 507}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="w0")
    fast.chat_template = TEMPLATE
    return fast


def image_chat_batch(hf, config, tmp_path):
    """An image chat JSON row rendered by the chat template (loss on the assistant's
    tokens and its <|im_end|>), as the loss reads it: the image inputs beside the tokens
    (input_tokens = the row less its last token)."""
    from easylm.data.text import TextProcessor

    picture(0, 24, 16).save(tmp_path / "photo.png")
    messages = [{"role": "user", "content": [{"type": "image", "image": "photo.png"},
                                             {"type": "text", "text": "w40 w41"}]},
                {"role": "assistant", "content": "w77 w78 w79"}]
    text = TextProcessor({"chat": True}, vl_tokenizer(config))
    reader = qwen_images.Qwen35ImageChats(config, qwen_images.load_image_processor(hf[0]))
    ids, masks, encoded = reader.encode_chat(
        text, messages, chat_images(messages, "chats.jsonl line 1", str(tmp_path)),
        "chats.jsonl line 1")
    assert list(ids[-4:]) == [77, 78, 79, 505] and masks.sum() == 4 and masks[-4:].all()
    assert (ids == config.image_token_id).sum() == 6  # 6 x 4 patches, 2 x 2 merged
    n = len(ids) - 1
    batch = {"input_tokens": np.zeros((1, T), np.int32),
             "target_tokens": np.zeros((1, T), np.int32),
             "loss_masks": np.zeros((1, T), np.float32),
             **qwen_images.image_inputs(config, [ids[:-1]], [encoded], T)}
    batch["input_tokens"][0, :n], batch["target_tokens"][0, :n] = ids[:-1], ids[1:]
    batch["loss_masks"][0, :n] = masks[1:]
    return ids, masks, encoded, {k: jnp.asarray(v) for k, v in batch.items()}


def test_sft_loss_on_an_image_chat_equals_transformers_labels_loss(hf, ours, tmp_path):
    """An image chat row (a local image file) rendered by the chat template; the
    next-token loss reads the batch's image inputs: = transformers' loss with labels -100
    outside the assistant's tokens; no gradient reaches the vision tower, frozen by default
    (tests/test_image_chats.py trains its projector); a few steps lower it."""
    from easylm.objectives.next_token import next_token_sums

    config, params = ours
    model = FAMILY.bind(config)
    ids, masks, encoded, batch = image_chat_batch(hf, config, tmp_path)
    row = torch.tensor(ids[None].astype(np.int64))
    labels = torch.where(torch.from_numpy(masks[None]) > 0, row, -100)
    with torch.no_grad():
        expected = hf[1](input_ids=row, labels=labels,
                         pixel_values=torch.from_numpy(np.concatenate([p for p, _ in encoded])),
                         image_grid_thw=torch.tensor([g for _, g in encoded]),
                         mm_token_type_ids=(row == config.image_token_id).int()).loss.item()

    def loss(params, batch):
        sums = next_token_sums(model, params, batch, None)
        return sums.loss / sums.tokens

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    first, grads = value_and_grad(params, batch)
    assert first == pytest.approx(expected, rel=REL)
    # The vision tower is frozen by default: no gradient, no backward pass through it.
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(grads["visual"]))
    losses = [float(first)]
    for _ in range(3):
        params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
        value, grads = value_and_grad(params, batch)
        losses.append(float(value))
    assert losses[-1] < losses[0], losses


def test_sharded_equals_single_device(hf, ours, forward):
    """Both towers placed by the partition rules over fsdp=2, mp=4 (image inputs split
    over the batch like the tokens): the log-probabilities of a one-image and a two-image
    chat = one device's, within REL (sharded sums add in other orders)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from easylm.runtime.sharding import BATCH_AXES, make_mesh, named_shardings

    config, params = ours
    chats = [prepared(hf, config, [picture(0, 24, 16)]),
             prepared(hf, config, [picture(0, 24, 16), picture(1, 16, 32)])]
    rows = np.zeros((2, T), np.int32)
    for b, (ids, _) in enumerate(chats):
        rows[b, :len(ids)] = ids
    inputs = qwen_images.image_inputs(config, [ids for ids, _ in chats],
                                      [encoded for _, encoded in chats], T)
    single = forward(params, jnp.asarray(rows), images=inputs).logits
    mesh = make_mesh("1,2,4")
    placed = jax.device_put(params, named_shardings(
        mesh, match_partition_rules(FAMILY.partition_rules(config), params)))
    split = lambda x: jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES, *(None,) * (x.ndim - 1))))  # noqa: E731
    with jax.set_mesh(mesh):
        sharded = jax.jit(FAMILY.bind(config).forward)(
            placed, split(rows), images={k: split(v) for k, v in inputs.items()}).logits
    assert placed["visual"]["blocks"]["0"]["attn"]["qkv"]["kernel"].sharding.spec == P("fsdp", "mp")
    assert_close(np.asarray(sharded), np.asarray(single), REL)
