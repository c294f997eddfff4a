"""Chats with images (easylm/data/image_chats.py) for Qwen3.5's image-text model, through
the data pipeline and `python -m easylm.train --family=qwen3_5_vl --load_checkpoint=hf::DIR`,
against transformers' Qwen3_5ForConditionalGeneration saved tiny and random by
transformers in the test with its PIL image processor and a word-level tokenizer whose
chat template writes Qwen3.5's image placeholder (tests/test_vision_qwen3_5.py's).

Tolerance: the step-1 loss is a mean of the log-probabilities test_vision_qwen3_5.py
compares at REL (fp32_rel(128, 70), derived there), over a handful of tokens: REL again.
"""

import contextlib
import io
import json
import os

import numpy as np
import pytest
import torch
from cli_utils import one_line_error
from numerics import assert_close, assert_differs
from PIL import Image
from test_vision_qwen3_5 import CONFIG, REL, picture, torch_model, vl_tokenizer
from transformers import Qwen2VLImageProcessorPil, Qwen3_5ForConditionalGeneration

from easylm.data import DatasetFactory
from easylm.errors import UserError
from easylm.qwen3_5.vision_hf import FAMILY

T = 40  # a row: the chat below (6 image tokens) is 21 tokens


def chat_row(image, question="w40 w41", answer="w77 w78 w79"):
    return {"messages": [
        {"role": "user", "content": [{"type": "image", "image": image},
                                     {"type": "text", "text": question}]},
        {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(a directory with transformers' model and its image processor, the model, the
    tokenizer's directory: apart, as AutoTokenizer would read a word-level tokenizer
    beside a qwen3_5 config.json as Qwen3.5's BPE)."""
    return saved_checkpoint(tmp_path_factory.mktemp("qwen3_5_vl_chats"))


def saved_checkpoint(directory):
    """`hf`'s tuple, in `directory`."""
    model = torch_model(CONFIG)
    model.save_pretrained(directory / "hf")
    Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                             size={"shortest_edge": 64, "longest_edge": 1024}
                             ).save_pretrained(directory / "hf")
    vl_tokenizer(CONFIG).save_pretrained(directory / "tokenizer")
    return str(directory / "hf"), model, str(directory / "tokenizer")


def write_data(folder, rows, pictures):
    """chats.jsonl in `folder`, beside the named pictures (PNG)."""
    for name, image in pictures.items():
        image.save(os.path.join(folder, name))
    path = os.path.join(folder, "chats.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def dataset(hf, path, type="json", **options):
    """The image chats of a json file (or a token cache's directory: type="cache")."""
    from easylm.data.tokenizer import load_tokenizer

    config = DatasetFactory.get_default_config({
        "type": type, "text_processor": {"chat": True},
        {"json": "json_dataset", "cache": "cache"}[type]:
            dict(dict(path=path, seq_length=T, batch_size=2), **options)})
    images = FAMILY.image_chats(FAMILY.hf.read_config(hf[0]), hf[0])
    return DatasetFactory.load_dataset(config, load_tokenizer(hf[2]), process_index=0,
                                       process_count=1, images=images)


def test_image_chat_rows(hf, tmp_path):
    """One chat a row (segment_ids=False; tests/test_image_packing.py packs), the image's placeholder one token per merged patch,
    loss on the assistant's tokens only, the image inputs beside the tokens; a chat whose
    image would be cut, and one whose image is missing, are skipped with their line."""
    path = write_data(tmp_path, [chat_row("a.png"), chat_row("b.png", answer="w5"),
                                 chat_row("missing.png")],
                      {"a.png": picture(0, 24, 16), "b.png": picture(1, 16, 32)})
    data = dataset(hf, path)
    batch, metrics = next(iter(data))
    data.close()
    image = CONFIG.image_token_id
    assert [(row == image).sum() for row in batch["input_tokens"]] == [6, 8]
    assert batch["patch_segments"].sum(axis=1).tolist() == [24, 32]  # 6x4 and 4x8 patches
    np.testing.assert_array_equal(batch["image_tokens"][0][batch["input_tokens"][0] == image],
                                  np.arange(6))
    targets = batch["target_tokens"][batch["loss_masks"] > 0]
    assert targets.tolist() == [77, 78, 79, 505, 5, 505]  # the answers and <|im_end|>
    assert batch["rope_positions"].shape == (2, T, 3)
    with pytest.raises(UserError, match=f"{path}:3: image .*missing.png: no such file"):
        next(iter(dataset(hf, path, strict=True, batch_size=1)))
    skipped = dataset(hf, path, batch_size=1)
    for _ in range(3):
        next(iter(skipped))
    assert skipped._first_skip.startswith(f"{path}:3: image ")
    skipped.close()
    late = chat_row("a.png")
    late["messages"][0]["content"].insert(0, {"type": "text", "text": " ".join(["w9"] * T)})
    long = chat_row("a.png", answer=" ".join(["w9"] * T))
    cut, kept = skipped.processor.process([(late, f"{path}:4"), (long, f"{path}:5")])
    assert cut == f"{path}:4: its image tokens reach token 49, past seq_length={T}: the " \
                  f"chat cannot be cut without cutting an image"
    assert len(kept[0]) == T + 1 and kept[1][-1] == 1  # cut at its end, the answer trained


def test_image_chats_refuse_what_they_cannot_meet(hf, tmp_path):
    from easylm.data.tokenizer import load_tokenizer
    from easylm.data.text import TextProcessor

    text = TextProcessor({"chat": True}, load_tokenizer(hf[2]))
    with pytest.raises(UserError, match="image parts, which only an image-text model reads"):
        text.process([(chat_row("a.png"), "chats.jsonl:1")])


def test_a_token_cache_refuses_image_chats_in_one_line(hf, tmp_path, capsys):
    from easylm.data import cache

    path = write_data(tmp_path, [chat_row("a.png")], {"a.png": picture(0, 24, 16)})
    error = one_line_error(cache.main, [
        "cache", f"--tokenizer={hf[2]}", "--train_dataset.text_processor.chat=True",
        f"--train_dataset.json_dataset.path={path}", f"--output={tmp_path / 'cache'}",
        "--processes=1"], capsys)
    assert error == (f"{path}:1: a message has image parts, which only an image-text model "
                     f"reads, from a json or huggingface source (e.g. --family=qwen3_5_vl, "
                     f"docs/vision.md); a token cache holds them when built with that "
                     f"--family")


def train(hf, data, output_dir, steps=3, *flags, family="qwen3_5_vl", length=T,
          source="json"):
    return [row["loss"] for row in train_metrics(hf, data, output_dir, steps, *flags,
                                                 family=family, length=length,
                                                 source=source)]


def train_metrics(hf, data, output_dir, steps, *flags, family="qwen3_5_vl", length=T,
                  source="json"):
    """The logged rows of `python -m easylm.train` on image chats `data` (fp32, batch 1,
    lr 1e-2) of a `source` (json, or cache: a token cache's directory); `flags` added last
    (a repeated flag's last value counts)."""
    block = {"json": "json_dataset", "cache": "cache"}[source]
    from easylm import train as command

    with contextlib.redirect_stdout(io.StringIO()):
        command.main(["train", f"--family={family}", f"--load_checkpoint=hf::{hf[0]}",
                      f"--tokenizer={hf[2]}", f"--total_steps={steps}", "--log_freq=1",
                      "--dtype=fp32", "--mesh_dim=1,1,-1", "--compilation_cache_dir=",
                      "--train_dataset.text_processor.chat=True",
                      f"--train_dataset.type={source}", f"--train_dataset.{block}.path={data}",
                      f"--train_dataset.{block}.seq_length={length}",
                      f"--train_dataset.{block}.batch_size=1",
                      f"--logger.output_dir={output_dir}", "--logger.experiment_id=run",
                      "--optimizer.adamw_optimizer.lr=1e-2",
                      "--optimizer.adamw_optimizer.lr_warmup_steps=0", *flags])
    with open(f"{output_dir}/run/metrics.jsonl") as f:
        return [row for row in map(json.loads, f) if "loss" in row]


def transformers_pieces(hf, image: Image.Image, messages):
    """(ids (1, L), where the last message's tokens start, the image's model inputs) of
    `messages` (the last an assistant's, the first holding one image part) as transformers'
    own processor's pieces make them: the tokenizer's chat template and the image
    processor."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf[2])
    processor = AutoImageProcessor.from_pretrained(hf[0])
    features = processor(images=[image], return_tensors="pt")
    n = int(features["image_grid_thw"].prod()) // 4
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False,
                                           add_generation_prompt=True)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    expand = lambda s: s.replace("<|image_pad|>", " ".join(["<|image_pad|>"] * n))  # noqa: E731
    ids = tokenizer(expand(text), add_special_tokens=False, return_tensors="pt").input_ids
    start = len(tokenizer(expand(prompt), add_special_tokens=False).input_ids)
    return ids, start, dict(pixel_values=features["pixel_values"],
                            image_grid_thw=features["image_grid_thw"],
                            mm_token_type_ids=(ids == CONFIG.image_token_id).int())


def transformers_inputs(hf, image: Image.Image, pieces=None) -> dict:
    """transformers' model inputs (labels -100 but on the assistant's tokens) of
    chat_row's chat with `image` (`pieces`: a family's test's transformers_pieces,
    Qwen3.5's by default)."""
    ids, start, vision = (pieces or transformers_pieces)(hf, image,
                                                         chat_row("x")["messages"])
    labels = ids.clone()
    labels[:, :start] = -100
    return dict(input_ids=ids, labels=labels, **vision)


def transformers_loss(hf, image: Image.Image) -> float:
    """transformers' labels loss on chat_row's chat with `image`."""
    with torch.no_grad():
        return hf[1](**transformers_inputs(hf, image)).loss.item()


def export_kept(hf, run, output_dir, model_class) -> tuple[set, set]:
    """(every tensor name, those bit for bit the starting model's) of `run`'s step-3
    checkpoint exported by `python -m easylm.convert_easylm_to_hf` and loaded in
    transformers as `model_class`, with no missing or unexpected weights."""
    from easylm import convert_easylm_to_hf as convert

    with contextlib.redirect_stdout(io.StringIO()):
        convert.main(["convert", f"--load_checkpoint=params::{run}/checkpoints/3",
                      f"--output_dir={output_dir}", "--verify=False"])
    model, info = model_class.from_pretrained(output_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    before, after = dict(hf[1].state_dict()), model.state_dict()
    return set(after), {name for name, tensor in after.items()
                        if torch.equal(tensor, before[name])}


def test_sft_through_the_command(hf, tmp_path, capsys):
    """Step 1's loss = transformers' labels loss on the same chat and image (another
    image: differs); 3 steps lower it; from the chat's token cache (`python -m
    easylm.data.cache --family=qwen3_5_vl`) the losses are the JSONL's bit for bit. With
    --qwen3_5_vl.train_vision=projector only the projector of the vision tower trains (its
    blocks keep their bits, weight decay and all); the export reloads whole in
    transformers."""
    path = write_data(tmp_path, [chat_row("a.png")], {"a.png": picture(0, 24, 16)})
    losses = train(hf, path, tmp_path / "out", 3, "--save_model_freq=3",
                   "--qwen3_5_vl.train_vision=projector")
    expected = transformers_loss(hf, picture(0, 24, 16))
    assert_close(np.asarray(losses[:1]), np.asarray([expected]), REL)
    assert_differs(np.asarray(losses[:1]),
                   np.asarray([transformers_loss(hf, picture(5, 24, 16))]), REL)
    assert losses[-1] < losses[0], losses
    # The same command on the cache (the same flags: a run of another length is another
    # program, its schedule's constants in it, which XLA may fuse otherwise: with
    # --xla_cpu_use_fusion_emitters=false a 1-step run's step-1 loss is 6.364340782 where
    # the 3-step run's is 6.364340305, from the JSONL and from the cache alike).
    build_cache(hf, path, tmp_path / "cache", capsys)
    assert train(hf, tmp_path / "cache", tmp_path / "cached", 3, "--save_model_freq=3",
                 "--qwen3_5_vl.train_vision=projector", source="cache") == losses

    after, same = export_kept(hf, tmp_path / "out/run", tmp_path / "export",
                              Qwen3_5ForConditionalGeneration)
    assert {n for n in after if n.startswith("model.visual.") and "merger" not in n} <= same
    assert "model.visual.merger.linear_fc2.weight" not in same
    assert "model.language_model.layers.0.mlp.up_proj.weight" not in same


def test_options_that_cannot_take_images_are_refused_in_one_line(hf, tmp_path, capsys):
    from easylm import train as command

    path = write_data(tmp_path, [chat_row("a.png")], {"a.png": picture(0, 24, 16)})
    common = ["train", "--family=qwen3_5_vl", f"--load_checkpoint=hf::{hf[0]}",
              f"--tokenizer={hf[2]}", "--train_dataset.text_processor.chat=True",
              f"--train_dataset.json_dataset.path={path}", f"--logger.output_dir={tmp_path}",
              "--train_dataset.json_dataset.seq_length=32"]
    for flags, message in (
            (["--objective=distill", f"--distill.teacher=hf::{hf[0]}",
              "--distill.max_new_tokens=4"],
             "--objective=distill does not read images as yet"),
            (["--mesh_dim=dp=1,fsdp=-1,sp=2", "--train_dataset.json_dataset.batch_size=4"],
             "sp=2 splits rows over devices, which image chats do not take yet"),
            (["--qwen3_5_vl.train_vision=some"], "train_vision='some' is not one of")):
        assert message in one_line_error(command.main, common + flags, capsys)


def test_preview_shows_each_image_as_one_marker_and_counts_them(hf, tmp_path, capsys):
    from easylm.data import preview

    path = write_data(tmp_path, [chat_row("a.png"), chat_row("b.png"), chat_row("gone.png")],
                      {"a.png": picture(0, 24, 16), "b.png": picture(1, 16, 32)})
    preview.main(["preview", "--family=qwen3_5_vl", f"--load_checkpoint=hf::{hf[0]}",
                  f"--tokenizer={hf[2]}", "--train_dataset.text_processor.chat=True",
                  f"--train_dataset.json_dataset.path={path}", "--num_batches=1",
                  f"--train_dataset.json_dataset.seq_length={T}",
                  "--train_dataset.json_dataset.batch_size=2"])
    out = capsys.readouterr().out
    assert "[[<|im_start|> user <|vision_start|>]][[<image 1: 6 tokens>]][[<|vision_end|>" in out
    assert "(21 tokens, 4 with loss, 1 image(s))" in out
    assert "(skipped: " + path + ":3: image " in out
    assert "images: 2, image tokens: 14" in out


def build_cache(hf, data, output, capsys, *flags, family="qwen3_5_vl"):
    """`python -m easylm.data.cache --family=...` of image chats `data`: its line."""
    from easylm.data import cache

    cache.main(["cache", f"--family={family}", f"--load_checkpoint=hf::{hf[0]}",
                f"--tokenizer={hf[2]}", "--train_dataset.text_processor.chat=True",
                f"--train_dataset.json_dataset.path={data}", f"--output={output}",
                "--processes=1", *flags])
    return capsys.readouterr().out


def test_a_token_cache_of_image_chats_gives_the_jsonl_batches(hf, tmp_path, capsys):
    """A cache built with --family holds the chats' tokens and their images' patches: its
    batches are the JSONL's bit for bit (test_sft_through_the_command trains from one: the
    same step-1 loss); a cache of another image gives other pixels, and nothing else."""
    rows = [chat_row("a.png"), chat_row("b.png", answer="w5")]
    path = write_data(tmp_path, rows, {"a.png": picture(0, 24, 16), "b.png": picture(1, 16, 32)})
    out = build_cache(hf, path, tmp_path / "cache", capsys)
    assert "2 documents (0 skipped), 38 tokens, 2 images (14 image tokens)" in out, out
    os.makedirs(tmp_path / "other")
    other = write_data(tmp_path / "other", rows, {"a.png": picture(5, 24, 16),
                                                  "b.png": picture(1, 16, 32)})
    build_cache(hf, other, tmp_path / "other-cache", capsys)
    batches = [next(iter(data)) for data in (
        dataset(hf, path), dataset(hf, str(tmp_path / "cache"), type="cache"),
        dataset(hf, str(tmp_path / "other-cache"), type="cache"))]
    (expected, _), (cached, _), (another, _) = batches
    assert expected.keys() == cached.keys() == another.keys()
    for key in expected:
        np.testing.assert_array_equal(cached[key], expected[key])
        assert key == "pixel_values" or np.array_equal(another[key], expected[key]), key
    assert not np.array_equal(another["pixel_values"], expected["pixel_values"])


def test_a_cache_of_image_chats_shows_its_images_and_names_a_mismatch(hf, tmp_path,
                                                                      capsys):
    """`preview` of the cache marks each image and counts them as for the JSONL; --verify
    counts them; a run without the image-text model, or with another image processor, an
    image-text run on a text cache, and image files that disagree are one line each."""
    import shutil

    from easylm.data import cache, preview
    from easylm.data.tokenizer import load_tokenizer

    path = write_data(tmp_path, [chat_row("a.png"), chat_row("b.png")],
                      {"a.png": picture(0, 24, 16), "b.png": picture(1, 16, 32)})
    build_cache(hf, path, tmp_path / "cache", capsys)
    cache.main(["cache", f"--output={tmp_path / 'cache'}", "--verify"])
    assert "2 images (14 image tokens); sizes, shapes" in capsys.readouterr().out
    preview.main(["preview", "--family=qwen3_5_vl", f"--load_checkpoint=hf::{hf[0]}",
                  f"--tokenizer={hf[2]}", "--train_dataset.text_processor.chat=True",
                  "--train_dataset.type=cache", f"--train_dataset.cache.path={tmp_path}/cache",
                  "--num_batches=1", f"--train_dataset.cache.seq_length={T}",
                  "--train_dataset.cache.batch_size=2"])
    out = capsys.readouterr().out
    assert "[[<|im_start|> user <|vision_start|>]][[<image 1: 6 tokens>]][[<|vision_end|>" in out
    assert "(21 tokens, 4 with loss, 1 image(s))" in out
    assert "images: 2, image tokens: 14" in out

    images = FAMILY.image_chats(FAMILY.hf.read_config(hf[0]), hf[0])

    def load(images, cache_path=tmp_path / "cache"):
        config = DatasetFactory.get_default_config({
            "type": "cache", "text_processor": {"chat": True},
            "cache": dict(path=str(cache_path), seq_length=T, batch_size=2)})
        return DatasetFactory.load_dataset(config, load_tokenizer(hf[2]), process_index=0,
                                           process_count=1, images=images)

    with pytest.raises(UserError, match="holds image chats, which only the image-text model"):
        load(None)
    table = np.load(tmp_path / "cache" / "shard-00000.images.npy")
    table[0, 0] += 1   # the same size, an image one patch longer than the patches hold
    np.save(tmp_path / "cache" / "shard-00000.images.npy", table)
    with pytest.raises(UserError, match="shard 0's image files do not describe its 2 images"):
        next(iter(load(images)))
    shutil.copytree(hf[0], tmp_path / "hf2")
    with open(tmp_path / "hf2" / "preprocessor_config.json") as f:
        settings = json.load(f)
    settings["image_mean"] = [0.25, 0.25, 0.25]
    with open(tmp_path / "hf2" / "preprocessor_config.json", "w") as f:
        json.dump(settings, f)
    other = FAMILY.image_chats(FAMILY.hf.read_config(hf[0]), str(tmp_path / "hf2"))
    with pytest.raises(UserError, match="built for another image-text model or image "
                                        "processor \\(image_processor_sha256"):
        load(other)
    from test_doctor import run_doctor

    code, _, err = run_doctor([
        "--family=qwen3_5_vl", f"--load_checkpoint=hf::{tmp_path / 'hf2'}",
        f"--tokenizer={hf[2]}", "--train_dataset.text_processor.chat=True",
        "--train_dataset.type=cache", f"--train_dataset.cache.path={tmp_path / 'cache'}",
        f"--logger.output_dir={tmp_path}"], capsys)
    assert code == 1 and "problem: token cache " in err and "image_processor_sha256" in err
    text = write_data(tmp_path / "hf2", [chat_row("w1")], {})
    with open(text, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "w1"},
                                         {"role": "assistant", "content": "w2"}]}) + "\n")
    cache.main(["cache", f"--tokenizer={hf[2]}", "--train_dataset.text_processor.chat=True",
                f"--train_dataset.json_dataset.path={text}", f"--output={tmp_path}/text",
                "--processes=1"])
    with pytest.raises(UserError, match="holds no images \\(built without --family\\)"):
        load(other, tmp_path / "text")
