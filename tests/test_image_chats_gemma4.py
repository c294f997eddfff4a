"""Chats with images for Gemma 4's image-text model through `python -m easylm.train
--family=gemma4_vl --load_checkpoint=hf::DIR`, against transformers'
Gemma4ForConditionalGeneration saved tiny and random by transformers in the test with its
PIL image processor (tests/test_vision_gemma4.py's) and a word-level tokenizer whose chat
template writes Gemma 4's image placeholder `<|image|>` (the processor's chat template,
saved beside the tokenizer as chat_template.jinja, as a processor saves it).

Tolerance: the step-1 loss is a mean of the log-probabilities test_vision_gemma4.py
compares at REL (fp32_rel(256, 110), derived there), over a handful of tokens: REL again.
"""

import numpy as np
import pytest
import torch
from numerics import assert_close, assert_differs
from PIL import Image
from test_image_chats import build_cache, chat_row, export_kept, train, write_data
from test_image_chats import transformers_inputs as qwen_inputs
from test_vision_gemma4 import CONFIG, REL, picture, torch_model
from transformers import Gemma4ForConditionalGeneration, Gemma4ImageProcessorPil

T = 96  # a row: the chat below (16 x 24 pixels: 60 soft tokens) is 78 tokens

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn> "
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }} {% if m['content'] is string %}"
    "{{ m['content'] }} {% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}"
    "{{ p['text'] }} {% else %}<|image|> {% endif %}{% endfor %}{% endif %}<end_of_turn> "
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn> model {% endif %}")


def gemma_tokenizer(config):
    """A word-level tokenizer whose image tokens have the checkpoint's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<pad>": config.pad_token_id, "<bos>": config.bos_token_id,
                "<eos>": config.eos_token_id, "<|image|>": config.image_token_id,
                "<boi>": config.boi_token_id, "<eoi>": config.eoi_token_id,
                "<start_of_turn>": 503, "<end_of_turn>": 504}
    vocab = {f"w{i}": i for i in range(3, 500)} | specials | {"user": 505, "model": 506}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>",
                                   eos_token="<end_of_turn>", pad_token="<pad>")
    fast.chat_template = TEMPLATE
    return fast


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(transformers' model and image processor's directory, the model, the tokenizer's
    directory)."""
    return saved_checkpoint(tmp_path_factory.mktemp("gemma4_vl_chats"))


def saved_checkpoint(directory):
    """`hf`'s tuple, in `directory`."""
    model = torch_model(CONFIG)
    model.save_pretrained(directory / "hf")
    Gemma4ImageProcessorPil(patch_size=2, max_soft_tokens=70, pooling_kernel_size=2
                            ).save_pretrained(directory / "hf")
    gemma_tokenizer(CONFIG).save_pretrained(directory / "tokenizer")
    return str(directory / "hf"), model, str(directory / "tokenizer")


def transformers_pieces(hf, image: Image.Image, messages):
    """(ids (1, L), where the last message's tokens start, the image's model inputs) of
    `messages` (the last an assistant's, the first holding one image part) through
    transformers' own processor's pieces: the chat template, the image processor, the
    processor's expansion of <|image|> (<boi>, one <|image|> per soft token, <eoi>)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf[2])
    processor = AutoImageProcessor.from_pretrained(hf[0])
    features = processor(images=[image], return_tensors="pt")
    n = int(features["num_soft_tokens_per_image"][0])
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False,
                                           add_generation_prompt=True)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    expand = lambda s: s.replace("<|image|>", " ".join(["<boi>"] + ["<|image|>"] * n  # noqa: E731
                                                      + ["<eoi>"]))
    ids = tokenizer(expand(text), add_special_tokens=False, return_tensors="pt").input_ids
    start = len(tokenizer(expand(prompt), add_special_tokens=False).input_ids)
    return ids, start, dict(pixel_values=features["pixel_values"],
                            image_position_ids=features["image_position_ids"],
                            mm_token_type_ids=(ids == CONFIG.image_token_id).int())


def transformers_inputs(hf, image: Image.Image) -> dict:
    """transformers' model inputs (labels -100 but on the assistant's tokens) of
    chat_row's chat with `image` (`transformers_pieces`)."""
    return qwen_inputs(hf, image, transformers_pieces)


def transformers_loss(hf, image: Image.Image) -> float:
    """transformers' labels loss on chat_row's chat with `image`."""
    with torch.no_grad():
        return hf[1](**transformers_inputs(hf, image)).loss.item()


def test_sft_through_the_command(hf, tmp_path):
    """Step 1's loss = transformers' labels loss on the same chat and image (another
    image: differs); 3 steps lower it. With --gemma4_vl.train_vision=projector only the
    projector (embed_vision) of the vision side trains; the export reloads whole in
    transformers."""
    path = write_data(tmp_path, [chat_row("a.png")], {"a.png": picture(0, 16, 24)})
    losses = train(hf, path, tmp_path / "out", 3, "--save_model_freq=3",
                   "--gemma4_vl.train_vision=projector", family="gemma4_vl", length=T)
    expected = transformers_loss(hf, picture(0, 16, 24))
    assert_close(np.asarray(losses[:1]), np.asarray([expected]), REL)
    assert_differs(np.asarray(losses[:1]),
                   np.asarray([transformers_loss(hf, picture(5, 16, 24))]), REL)
    assert losses[-1] < losses[0], losses

    after, same = export_kept(hf, tmp_path / "out/run", tmp_path / "export",
                              Gemma4ForConditionalGeneration)
    assert {n for n in after if n.startswith("model.vision_tower.")} <= same
    assert "model.embed_vision.embedding_projection.weight" not in same
    assert "model.language_model.layers.0.mlp.up_proj.weight" not in same


def test_preview_and_bad_images(hf, tmp_path, capsys):
    """preview shows each image as one marker between <boi> and <eoi>, and counts images
    and image tokens; a missing image and a file that is no image skip their rows with
    one line naming the file and the row, and with strict=True the command stops with
    that one line (the same for every image-text family: easylm/data/images.py)."""
    from cli_utils import one_line_error

    from easylm.data import preview

    (tmp_path / "broken.png").write_bytes(b"not a picture")
    path = write_data(tmp_path, [chat_row("a.png"), chat_row("gone.png"),
                                 chat_row("broken.png"), chat_row("b.png")],
                      {"a.png": picture(0, 16, 24), "b.png": picture(1, 32, 32)})
    argv = ["preview", "--family=gemma4_vl", f"--load_checkpoint=hf::{hf[0]}",
            f"--tokenizer={hf[2]}", "--train_dataset.text_processor.chat=True",
            f"--train_dataset.json_dataset.path={path}", "--num_batches=1",
            "--train_dataset.json_dataset.seq_length=160",
            "--train_dataset.json_dataset.batch_size=2"]
    preview.main(argv)
    out = capsys.readouterr().out
    assert "<start_of_turn> user <boi>]][[<image 1: 60 tokens>]][[<eoi>" in out, out
    assert f"(skipped: {path}:2: image {tmp_path}/gone.png: no such file)" in out
    assert f"(skipped: {path}:3: image broken.png: cannot be read as an image" in out
    assert "images: 2, image tokens: 124" in out
    error = one_line_error(preview.main, argv + ["--train_dataset.json_dataset.strict=True"],
                           capsys)
    assert error == f"{path}:2: image {tmp_path}/gone.png: no such file"


def test_a_token_cache_of_gemma_image_chats_gives_the_jsonl_batches(hf, tmp_path, capsys):
    """Gemma 4's 2-D grids and <boi>/<eoi> expansion through the token cache: its batches
    are the JSONL's bit for bit (test_image_chats.py trains from a Qwen3.5 cache)."""
    from easylm.data import DatasetFactory
    from easylm.data.tokenizer import load_tokenizer
    from easylm.gemma4.vision_hf import FAMILY

    path = write_data(tmp_path, [chat_row("a.png"), chat_row("b.png")],
                      {"a.png": picture(0, 16, 24), "b.png": picture(1, 32, 32)})
    out = build_cache(hf, path, tmp_path / "cache", capsys, family="gemma4_vl")
    assert "2 images (124 image tokens)" in out, out
    images = FAMILY.image_chats(FAMILY.hf.read_config(hf[0]), hf[0])
    batches = []
    for kind, block, source in (("json", "json_dataset", path),
                                ("cache", "cache", str(tmp_path / "cache"))):
        config = DatasetFactory.get_default_config({
            "type": kind, "text_processor": {"chat": True},
            block: dict(path=source, seq_length=160, batch_size=2)})
        data = DatasetFactory.load_dataset(config, load_tokenizer(hf[2]), process_index=0,
                                           process_count=1, images=images)
        batches.append(next(iter(data))[0])
        data.close()
    assert batches[0].keys() == batches[1].keys()
    for key in batches[0]:
        np.testing.assert_array_equal(batches[1][key], batches[0][key])
