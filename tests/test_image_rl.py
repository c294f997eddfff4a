"""DPO and GRPO on prompts with images (Qwen3.5's image-text model) through
`python -m easylm.train`, against transformers' Qwen3_5ForConditionalGeneration saved tiny
and random in the test (tests/test_image_chats.py's checkpoint, processor and tokenizer).

Tolerance: the logged log-probabilities are sums over a handful of response tokens of the
log-probabilities test_vision_qwen3_5.py compares at REL (fp32_rel(128, 70), derived
there): REL of the largest again.
"""

import json
import math
import os

import numpy as np
import pytest
import torch
from PIL import Image
from numerics import assert_close, assert_differs
from test_image_chats import (  # noqa: F401 (hf: the fixture)
    hf,
    train_metrics,
    transformers_pieces,
    write_data,
)
from test_vision_qwen3_5 import CONFIG, REL, picture

T = 40


def pair_row(image, chosen="w77 w78", rejected="w5 w6 w7"):
    """A preference pair whose prompt (one user message) holds an image; the replies
    are strings after it."""
    return {"prompt": [{"role": "user", "content": [{"type": "image", "image": image},
                                                    {"type": "text", "text": "w40 w41"}]}],
            "chosen": chosen, "rejected": rejected}


def run(hf, data, output_dir, steps, *flags, source="json"):  # noqa: F811 (hf: the fixture's value)
    """The logged rows of `python -m easylm.train` on `data` (a json file, or a token
    cache: source="cache"), each row's images together at most 32 patches (the 24 x 16
    picture's 24: 6 image tokens)."""
    return train_metrics(hf, data, output_dir, steps, "--qwen3_5_vl.max_image_patches=32",
                         *flags, source=source)


def reply_logps(hf, image, reply: str, pieces=transformers_pieces) -> float:  # noqa: F811
    """transformers' summed log-probability of `reply` (and its end-of-turn token) after
    pair_row's prompt with `image`, the chat rendered by the tokenizer's template and
    `pieces` (a family's test's transformers_pieces: Qwen3.5's by default)."""
    messages = pair_row("x")["prompt"] + [{"role": "assistant", "content": reply}]
    ids, start, vision = pieces(hf, image, messages)
    with torch.no_grad():
        logits = hf[1](input_ids=ids, **vision).logits.double()
    logps = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    # The targets from the reply on, to its <|im_end|> (the rendered chat's last token).
    return float(logps[start - 1:].sum())


def test_image_pair_rows(hf, tmp_path):  # noqa: F811
    """An image pair's sides: the prompt's image expanded to its tokens on both, loss on
    each reply (and its <|im_end|>) only, each side's image inputs beside its rows (the
    same patches); a pair whose image is missing is skipped with its file and line."""
    from easylm.data import DatasetFactory
    from easylm.data.tokenizer import load_tokenizer
    from easylm.errors import UserError
    from easylm.qwen3_5.vision_hf import FAMILY

    path = write_data(tmp_path, [pair_row("a.png"), pair_row("missing.png")],
                      {"a.png": picture(0, 24, 16)})

    def pairs(**options):
        config = DatasetFactory.get_default_config({
            "text_processor": {"chat": True}, "preference": {"enabled": True},
            "json_dataset": dict(dict(path=path, seq_length=T, batch_size=1), **options)})
        return DatasetFactory.load_dataset(
            config, load_tokenizer(hf[2]), process_index=0, process_count=1, pairs=True,
            images=FAMILY.image_chats(FAMILY.hf.read_config(hf[0]), hf[0]))

    data = pairs()
    batch, _ = next(iter(data))
    data.close()
    for side, reply in (("chosen", [77, 78]), ("rejected", [5, 6, 7])):
        tokens = batch[f"{side}_input_tokens"][0]
        assert (tokens == CONFIG.image_token_id).sum() == 6
        masks = batch[f"{side}_loss_masks"][0] > 0
        assert batch[f"{side}_target_tokens"][0][masks].tolist() == reply + [505]
        assert batch[f"{side}_patch_segments"].sum() == 24  # 6 x 4 patches
    np.testing.assert_array_equal(batch["chosen_pixel_values"], batch["rejected_pixel_values"])
    with pytest.raises(UserError, match=f"{path}:2: image .*missing.png: no such file"):
        data = pairs(strict=True)
        for _ in range(2):
            next(iter(data))


def image_pairs(hf, path, source="json", **options):  # noqa: F811
    """Image preference pairs from a json file or a token cache's directory."""
    from easylm.data import DatasetFactory
    from easylm.data.tokenizer import load_tokenizer
    from easylm.qwen3_5.vision_hf import FAMILY

    block = {"json": "json_dataset", "cache": "cache"}[source]
    config = DatasetFactory.get_default_config({
        "type": source, "text_processor": {"chat": True}, "preference": {"enabled": True},
        block: dict(dict(path=str(path), seq_length=T, batch_size=2), **options)})
    return DatasetFactory.load_dataset(
        config, load_tokenizer(hf[2]), process_index=0, process_count=1, pairs=True,
        images=FAMILY.image_chats(FAMILY.hf.read_config(hf[0]), hf[0]))


def pair_cache(hf, data, output, capsys, *flags):  # noqa: F811
    """`python -m easylm.data.cache --family=qwen3_5_vl` of image pairs `data`: its line."""
    from test_image_chats import build_cache

    return build_cache(hf, data, output, capsys, "--train_dataset.preference.enabled=True",
                       *flags)


def test_a_token_cache_of_image_pairs_gives_the_jsonl_batches(hf, tmp_path, capsys):  # noqa: F811
    """A cache of image pairs holds each pair's sides whole and their images' patches:
    its batches are the JSONL's bit for bit (a pair cut to the run's rows as the JSONL's,
    a pair whose image is missing skipped in both); a cache of another image differs in
    the pixels only; read as chats, or with other pair fields, one line each."""
    from easylm.errors import UserError

    rows = [pair_row("a.png"), pair_row("b.png", rejected=" ".join(["w9"] * T)),
            pair_row("missing.png")]
    path = write_data(tmp_path, rows, {"a.png": picture(0, 24, 16),
                                       "b.png": picture(1, 16, 32)})
    out = pair_cache(hf, path, tmp_path / "cache", capsys)
    assert "3 documents (1 skipped)" in out and "4 images (28 image tokens)" in out, out
    os.makedirs(tmp_path / "other")
    other = write_data(tmp_path / "other", rows, {"a.png": picture(5, 24, 16),
                                                  "b.png": picture(1, 16, 32)})
    pair_cache(hf, other, tmp_path / "other-cache", capsys)
    got = []
    for source, where in (("json", path), ("cache", tmp_path / "cache"),
                          ("cache", tmp_path / "other-cache")):
        data = image_pairs(hf, where, source)
        got.append(next(iter(data))[0])
        data.close()
    expected, cached, another = got
    assert expected.keys() == cached.keys() == another.keys()
    assert expected["rejected_loss_masks"][1].sum() > 0   # b's long reply, cut
    for key in expected:
        np.testing.assert_array_equal(cached[key], expected[key])
        assert "pixel_values" in key or np.array_equal(another[key], expected[key]), key
    assert not np.array_equal(another["chosen_pixel_values"], expected["chosen_pixel_values"])
    with pytest.raises(UserError, match="holds preference pairs: read it with "
                                        "--train_dataset.preference.enabled=True"):
        from test_image_chats import dataset

        dataset(hf, str(tmp_path / "cache"), type="cache")
    from easylm.data import DatasetFactory
    from easylm.data.tokenizer import load_tokenizer
    from easylm.qwen3_5.vision_hf import FAMILY

    config = DatasetFactory.get_default_config({
        "type": "cache", "text_processor": {"chat": True},
        "preference": {"enabled": True, "chosen_field": "better"},
        "cache": dict(path=str(tmp_path / "cache"), seq_length=T, batch_size=2)})
    with pytest.raises(UserError, match="built with preference.chosen_field='chosen' but "
                                        "this run has preference.chosen_field='better'"):
        DatasetFactory.load_dataset(
            config, load_tokenizer(hf[2]), process_index=0, process_count=1, pairs=True,
            images=FAMILY.image_chats(FAMILY.hf.read_config(hf[0]), hf[0]))


@pytest.mark.extended
def test_dpo_on_image_prompts_through_the_command(hf, tmp_path, capsys):  # noqa: F811
    """Step 1's log-probabilities of chosen and rejected = transformers' on the same chats
    and image (another image: differs), so its loss is DPO's with the reference = the
    policy: log 2, exactly; 3 steps lower it and the margin grows. From the pair's token
    cache the same command logs the JSONL's losses and log-probabilities bit for bit (3
    steps as well: a run of another length is another program, which XLA may fuse
    otherwise; tests/test_image_chats.py::test_sft_through_the_command)."""
    path = write_data(tmp_path, [pair_row("a.png")], {"a.png": picture(0, 24, 16)})
    rows = check_dpo(hf, tmp_path, run, [picture(0, 24, 16), picture(5, 24, 16)],
                     transformers_pieces, REL)
    pair_cache(hf, path, tmp_path / "cache", capsys)
    cached = run(hf, tmp_path / "cache", tmp_path / "cached", 3, "--objective=dpo",
                 source="cache")
    for key in ("loss", "logps/chosen", "logps/rejected"):
        assert [row[key] for row in cached] == [row[key] for row in rows], key


def check_dpo(hf, tmp_path, run, pictures, pieces, rel):  # noqa: F811
    """3 steps of `run` (a family's `python -m easylm.train`) with --objective=dpo on
    pair_row's pair with pictures[0] (written as a.png): step 1's log-probabilities of
    chosen and rejected = transformers' (`pieces`), another image (pictures[1]) misses
    them, the loss is DPO's, 3 steps lower it and the margin grows. Returns the rows."""
    path = write_data(tmp_path, [pair_row("a.png")], {"a.png": pictures[0]})
    rows = run(hf, path, tmp_path / "out", 3, "--objective=dpo")
    got = np.asarray([rows[0]["logps/chosen"], rows[0]["logps/rejected"]])
    want, other = (np.asarray([reply_logps(hf, image, reply, pieces)
                               for reply in ("w77 w78", "w5 w6 w7")]) for image in pictures)
    assert_close(got, want, rel)
    assert_differs(got, other, rel)
    # DPO (Rafailov et al. 2023, eq. 7) from transformers' log-probabilities, beta 0.1:
    # the reference is the starting policy, so h = 0.
    beta = 0.1
    h = beta * ((want[0] - want[0]) - (want[1] - want[1]))
    assert math.isclose(rows[0]["loss"], -math.log(1 / (1 + math.exp(-h))), rel_tol=1e-6)
    assert rows[-1]["loss"] < rows[0]["loss"], [row["loss"] for row in rows]
    assert rows[-1]["rewards/margin"] > 0
    return rows


# ------------------------------------------------------------------ GRPO on image prompts

COLOURS = {"w10": (200, 30, 30), "w11": (30, 30, 200)}  # the answer word: red, blue


def colour_picture(word: str, seed: int, size: int = 8) -> Image.Image:
    """A size x size image of `word`'s colour with noise. 8 x 8 pixels is the image
    processor's smallest (shortest_edge 64 pixels): 2 x 2 patches of 4, one image token,
    whose multimodal rotary leaves the text after it where 1-D positions put it."""
    rng = np.random.RandomState(seed)
    pixels = np.asarray(COLOURS[word]) + rng.randint(-25, 26, (size, size, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def colour_prompt(path: str) -> dict:
    return {"prompt": [{"role": "user", "content": [{"type": "image", "image": path},
                                                    {"type": "text", "text": "w40"}]}]}


def colour_reward(prompts, completions, **fields):
    """1 where the completion names the colour that fills the prompt's image: read from
    the image itself (its mean red against its mean blue), not from any field."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        path = next(part["image"] for part in prompt[0]["content"] if part["type"] == "image")
        red, _, blue = np.asarray(Image.open(path).convert("RGB"), np.float64).mean((0, 1))
        word = "w10" if red > blue else "w11"
        text = completion[0]["content"] if isinstance(completion, list) else completion
        rewards.append(float(text.split()[:1] == [word]))
    return rewards


def greedy_with_transformers(model, ids, vision: dict, steps: int):
    """(tokens, their log-probabilities) of `steps` greedy tokens after `ids`, each from
    transformers' forward over the whole row with the image's model inputs `vision`
    (float64 log-softmax)."""
    row, tokens, logps = list(ids), [], []
    for _ in range(steps):
        x = torch.tensor([row])
        with torch.no_grad():
            logits = model(input_ids=x, **vision,
                           mm_token_type_ids=(x == model.config.image_token_id).int()).logits
        last = torch.log_softmax(logits[0, -1].double(), -1)
        tokens.append(int(last.argmax()))
        logps.append(float(last.max()))
        row.append(tokens[-1])
    return tokens, np.asarray(logps)


def check_image_prefill(family, directory, text, seq_length, greedy, rel, size: int = 8):
    """Two prompts of tokens `text` alike but for their image (colour_picture 0 and 1),
    prefilled by the engine with their images' embeddings (engine.PromptImages, not
    shared: their keys differ), then decoded: 4 greedy tokens each = `greedy(ids, picture)`'s
    (transformers') and their log-probabilities within `rel` of the largest; the twin, each
    prompt prefilled with the other's image, misses them."""
    from easylm.objectives.rollouts import generate
    from easylm.serving import engine as engine_lib

    config = family.hf.read_config(directory)
    reader = family.image_chats(config, directory)
    pictures = [colour_picture("w10", 0, size), colour_picture("w11", 1, size)]
    prompts = [reader.encode_prompt(text, [p], "test") for p in pictures]
    ids = [list(p) for p, _ in prompts]
    engine = engine_lib.Engine({"batch_size": 2, "seq_length": seq_length,
                                "min_bucket": seq_length, "decode_steps": 4,
                                "prefill_chunk_size": 0},
                               family.bind(config), family.hf.read_params(directory, config))

    def ours(order):
        engine.reset()
        tokens, logps = generate(engine, ids, engine_lib.Sampling.empty(2), 4, None,
                                 images=engine_lib.PromptImages([0, 1], lambda requests, T: (
                                     reader.batch_inputs([[0] if i is None else ids[i]
                                                          for i in requests],
                                                         [[] if i is None else
                                                          prompts[order[i]][1]
                                                          for i in requests], T))))
        return tokens, np.asarray(logps)

    tokens, logps = ours([0, 1])
    for row in range(2):
        want_tokens, want_logps = greedy(ids[row], pictures[row])
        assert tokens[row] == want_tokens
        assert_close(logps[row], want_logps, rel)
    _, swapped = ours([1, 0])  # each prompt prefilled with the other's image
    assert_differs(swapped[0], greedy(ids[0], pictures[0])[1], rel)


@pytest.mark.parametrize("size", [8, 16])
def test_the_engine_prefills_a_prompts_images(hf, size):  # noqa: F811
    """check_image_prefill for Qwen3.5: a one-token image (8 x 8 pixels), and one of 2 x 2
    merged patches (16 x 16), whose 4 tokens advance the multimodal rotary by 2: the
    decode after it must add the cache's `rope_delta` (-2) to its positions."""
    from easylm.qwen3_5 import images as qwen_images
    from easylm.qwen3_5.vision_hf import FAMILY

    processor = qwen_images.load_image_processor(hf[0])

    def greedy(ids, picture):
        (patches, grid), = qwen_images.encode_images(processor, [picture], CONFIG)
        return greedy_with_transformers(hf[1], ids, dict(
            pixel_values=torch.from_numpy(patches), image_grid_thw=torch.tensor([grid])), 4)

    check_image_prefill(FAMILY, hf[0], [1, 17, CONFIG.vision_start_token_id,
                                        CONFIG.image_token_id, CONFIG.vision_end_token_id,
                                        40, 41], 16, greedy, REL, size)


def test_image_prompts_share_a_prefill_only_with_the_same_image(hf):  # noqa: F811
    """The rollouts key a prompt's images by their content (vision.images_key): of three
    prompts with equal tokens, the two with equal images (two PIL images of the same
    pixels) share one prefill row (and, in a model with no state in its cache, its
    pages: `_prompt_pages` takes the same key), the third, another image, gets its own;
    keyed by prompt (the twin) none share."""
    from types import SimpleNamespace

    from easylm.objectives.rollouts import Rollouts
    from easylm.qwen3_5.vision_hf import FAMILY
    from easylm.serving import engine as engine_lib

    config = FAMILY.hf.read_config(hf[0])
    reader = FAMILY.image_chats(config, hf[0])
    text = [1, 17, config.vision_start_token_id, config.image_token_id,
            config.vision_end_token_id, 40, 41]
    pictures = [colour_picture("w10", 0), colour_picture("w10", 0), colour_picture("w10", 1)]
    prompts = [reader.encode_prompt(text, [p], "test") for p in pictures]
    ids = [list(p) for p, _ in prompts]
    assert ids[0] == ids[1] == ids[2]
    engine = engine_lib.Engine({"batch_size": 3, "seq_length": 16, "min_bucket": 16,
                                "decode_steps": 4, "prefill_chunk_size": 0},
                               FAMILY.bind(config), FAMILY.hf.read_params(hf[0], config))

    # The rollouts' PromptImages of these prompts, one completion each.
    rollouts = SimpleNamespace(options=SimpleNamespace(num_generations=1),
                               objective=SimpleNamespace(environment=None, images=reader))
    images = Rollouts._prompt_images(rollouts, {"image_encodings": [e for _, e in prompts]},
                                     ids)

    def rows(keys):
        engine.prompt_tokens = {"prefilled": 0, "cached": 0}
        (call, requests), = engine._calls(ids, [0, 1, 2], engine_lib.PromptImages(
            keys, images.lay_out))
        return call.source[:len(requests)].tolist(), engine.prompt_tokens["cached"]

    assert rows(images.keys) == ([0, 0, 1], len(ids[0]))
    assert rows([0, 1, 2]) == ([0, 1, 2], 0)


@pytest.mark.extended
def test_grpo_on_image_prompts_through_the_command(hf, tmp_path):  # noqa: F811
    """Rollouts prefill each prompt's image: the engine's log-probabilities of the
    sampled tokens = the training forward's on the same rows and images (sampler_logp_diff,
    temperature 1: fp32 sums of REL order); the reward reads the image; 2 steps run."""
    check_grpo(hf, tmp_path, run)


def check_grpo(hf, tmp_path, run):  # noqa: F811
    """2 steps of `run` (a family's `python -m easylm.train`) with --objective=grpo on 4
    colour prompts x 4 completions, colour_reward reading the images: the engine's and the
    training forward's log-probabilities of the sampled tokens agree."""
    words = ["w10", "w11", "w11", "w10"]
    rows = []
    for k, word in enumerate(words):
        path = str(tmp_path / f"{k}.png")
        colour_picture(word, k).save(path)
        rows.append(colour_prompt(path))
    with open(tmp_path / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    metrics = run(hf, tmp_path / "prompts.jsonl", tmp_path / "out", 2, "--objective=grpo",
                  "--grpo.num_generations=4", "--grpo.max_new_tokens=4",
                  "--grpo.reward_funcs=test_image_rl:colour_reward",
                  "--train_dataset.json_dataset.batch_size=2")
    assert len(metrics) == 2
    for row in metrics:
        assert row["data/rollout/sampler_logp_diff_max"] < 1e-3, row


# ------------------------------------------- the learning task: which colour fills it

def colour_data(folder, seeds, kind: str):
    """JSON lines of `kind` (chats for SFT, prompts for GRPO) over images of the two
    colours, alternating, one per seed; (path, the right words)."""
    rows, words = [], []
    for k, seed in enumerate(seeds):
        word = sorted(COLOURS)[k % 2]
        path = os.path.join(folder, f"{kind}_{seed}.png")
        colour_picture(word, seed).save(path)
        row = colour_prompt(path)
        if kind == "chats":
            row = {"messages": row["prompt"] + [{"role": "assistant", "content": word}]}
        rows.append(row)
        words.append(word)
    data = os.path.join(folder, f"{kind}.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return data, words


def held_out_accuracy(directory, tokenizer, folder, seeds) -> float:
    """The share of held-out images whose colour word transformers' model (an export,
    `directory`) prefers of the two at the answer's first token: 0.5 is chance."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(directory).eval()
    tok = AutoTokenizer.from_pretrained(tokenizer)
    processor = AutoImageProcessor.from_pretrained(directory)
    ids = [tok.convert_tokens_to_ids(word) for word in sorted(COLOURS)]
    data, words = colour_data(folder, seeds, "held_out")
    right = 0
    for line, word in zip(open(data), words):
        messages = json.loads(line)["prompt"]
        image = Image.open(messages[0]["content"][0]["image"])
        features = processor(images=[image], return_tensors="pt")
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        n = int(features["image_grid_thw"].prod()) // 4
        text = text.replace("<|image_pad|>", " ".join(["<|image_pad|>"] * n))
        x = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(input_ids=x, pixel_values=features["pixel_values"],
                           image_grid_thw=features["image_grid_thw"],
                           mm_token_type_ids=(x == CONFIG.image_token_id).int()).logits
        right += sorted(COLOURS)[int(logits[0, -1, ids].argmax())] == word
    return right / len(words)


@pytest.mark.extended
def test_sft_then_grpo_learn_the_colour_and_the_control_stays_at_chance(hf, tmp_path):  # noqa: F811
    """SFT on image chats, then GRPO on image prompts with colour_reward (which reads the
    image), both through `python -m easylm.train`: the held-out accuracy (32 images of
    seeds never trained on) rises well above chance (0.5); with learning rate 0 for both
    stages (the control) it stays at chance. Figures: docs/vision.md."""
    import shutil

    from easylm import convert_easylm_to_hf as convert

    tokenizer = tmp_path / "tokenizer"  # with the image processor: params:: runs read it
    shutil.copytree(hf[2], tokenizer)
    shutil.copy(os.path.join(hf[0], "preprocessor_config.json"), tokenizer)
    chats, _ = colour_data(str(tmp_path), range(1000, 1032), "chats")
    prompts, _ = colour_data(str(tmp_path), range(2000, 2032), "prompts")
    held_out = range(3000, 3032)
    results = {}
    for name, lr in (("trained", "3e-3"), ("control", "0")):
        out = tmp_path / name
        common = [f"--tokenizer={tokenizer}", f"--optimizer.adamw_optimizer.lr={lr}",
                  "--train_dataset.json_dataset.batch_size=8", "--save_model_freq=8",
                  "--qwen3_5_vl.max_image_patches=4"]
        run(hf, chats, out / "sft", 8, *common)
        convert.main(["convert", f"--load_checkpoint=params::{out}/sft/run/checkpoints/8",
                      f"--output_dir={out / 'sft_hf'}", "--verify=False"])
        shutil.copy(os.path.join(hf[0], "preprocessor_config.json"), out / "sft_hf")
        sft = held_out_accuracy(out / "sft_hf", tokenizer, str(tmp_path), held_out)
        run(hf, prompts, out / "grpo", 8, *common,
            f"--load_checkpoint=params::{out}/sft/run/checkpoints/8", "--objective=grpo",
            "--grpo.num_generations=4", "--grpo.max_new_tokens=2",
            "--grpo.reward_funcs=test_image_rl:colour_reward",
            "--train_dataset.json_dataset.batch_size=4")
        convert.main(["convert", f"--load_checkpoint=params::{out}/grpo/run/checkpoints/8",
                      f"--output_dir={out / 'grpo_hf'}", "--verify=False"])
        shutil.copy(os.path.join(hf[0], "preprocessor_config.json"), out / "grpo_hf")
        grpo = held_out_accuracy(out / "grpo_hf", tokenizer, str(tmp_path), held_out)
        results[name] = {"sft": sft, "sft_then_grpo": grpo}
    results["untrained"] = held_out_accuracy(hf[0], tokenizer, str(tmp_path), held_out)
    print(json.dumps(results))
    # lr 0: the parameters keep their bits, so the control is the untrained model's chance.
    assert results["control"] == {"sft": results["untrained"],
                                  "sft_then_grpo": results["untrained"]}, results
    assert 0.25 <= results["untrained"] <= 0.75, results
    assert results["trained"]["sft_then_grpo"] >= 0.75, results
