"""DPO and GRPO on prompts with images for Gemma 4's image-text model: tests/test_image_rl.py's
tests (Qwen3.5's) run for gemma4_vl, against transformers' Gemma4ForConditionalGeneration
saved tiny and random in the test (tests/test_image_chats_gemma4.py's checkpoint, PIL image
processor and tokenizer). Gemma 4's image is <boi>, one <|image|> per soft token, <eoi>, its
soft tokens see each other both ways: the rollouts' prefill and the preference rows carry
that as the chats do.

Tolerance: the logged and the engine's log-probabilities are sums over a handful of tokens
(or single tokens) of the log-probabilities test_vision_gemma4.py compares at REL
(fp32_rel(256, 110), derived there): REL of the largest again.
"""

import numpy as np
import pytest
from test_image_chats import train_metrics, write_data
from test_image_chats_gemma4 import (  # noqa: F401 (hf: the fixture)
    hf,
    transformers_pieces,
)
from test_image_rl import (
    check_dpo,
    check_grpo,
    check_image_prefill,
    greedy_with_transformers,
    pair_row,
)
from test_vision_gemma4 import CONFIG, REL, picture

T = 112  # a row: a prompt with one image (70 soft tokens at most) and its reply


def run(hf, data, output_dir, steps, *flags):  # noqa: F811 (hf: the fixture's value)
    """The logged rows of `python -m easylm.train --family=gemma4_vl` on `data`, each
    row's images together at most 280 patches (the image processor's budget: 70 soft
    tokens of 2 x 2 patches)."""
    return train_metrics(hf, data, output_dir, steps, "--gemma4_vl.max_image_patches=280",
                         *flags, family="gemma4_vl", length=T)


def test_gemma_image_pair_rows(hf, tmp_path):  # noqa: F811
    """An image pair's sides: the prompt's image written <boi>, its soft tokens, <eoi> on
    both, loss on each reply (and its <end_of_turn>) only, each side's image inputs beside
    its rows (the same patches)."""
    from easylm.data import DatasetFactory
    from easylm.data.tokenizer import load_tokenizer
    from easylm.gemma4.vision_hf import FAMILY

    path = write_data(tmp_path, [pair_row("a.png")], {"a.png": picture(0, 16, 24)})
    config = DatasetFactory.get_default_config({
        "text_processor": {"chat": True}, "preference": {"enabled": True},
        "json_dataset": dict(path=path, seq_length=T, batch_size=1)})
    data = DatasetFactory.load_dataset(
        config, load_tokenizer(hf[2]), process_index=0, process_count=1, pairs=True,
        images=FAMILY.image_chats(FAMILY.hf.read_config(hf[0]), hf[0]))
    batch, _ = next(iter(data))
    data.close()
    for side, reply in (("chosen", [77, 78]), ("rejected", [5, 6, 7])):
        tokens = batch[f"{side}_input_tokens"][0]
        n = (tokens == CONFIG.image_token_id).sum()
        assert n == (batch[f"{side}_image_tokens"][0] >= 0).sum() > 0
        begin = np.flatnonzero(tokens == CONFIG.boi_token_id)
        assert len(begin) == 1 and tokens[begin[0] + n + 1] == CONFIG.eoi_token_id
        masks = batch[f"{side}_loss_masks"][0] > 0
        assert batch[f"{side}_target_tokens"][0][masks].tolist() == reply + [504]
        assert batch[f"{side}_patch_segments"].sum() == 4 * n  # 2 x 2 patches a soft token
    np.testing.assert_array_equal(batch["chosen_pixel_values"], batch["rejected_pixel_values"])


@pytest.mark.extended
def test_gemma_dpo_on_image_prompts_through_the_command(hf, tmp_path):  # noqa: F811
    """test_image_rl.check_dpo for Gemma 4: step 1's log-probabilities = transformers',
    another image misses them, loss log 2, 3 steps lower it."""
    check_dpo(hf, tmp_path, run, [picture(0, 16, 24), picture(5, 16, 24)],
              transformers_pieces, REL)


@pytest.mark.extended
def test_the_engine_prefills_gemma_prompts_images(hf):  # noqa: F811
    """test_image_rl.check_image_prefill for Gemma 4: each prompt's soft tokens (seeing
    each other both ways) prefilled, 4 greedy tokens = transformers'. Extended (25 s, as
    Gemma 4's served image chat in test_serving_images): in CI test_image_rl's Qwen3.5 run
    covers the engine's image prefill path, and test_image_packing Gemma 4's two-way
    attention inside a segment."""
    from transformers import AutoImageProcessor

    from easylm.gemma4.vision_hf import FAMILY

    text = [CONFIG.bos_token_id, 503, 505, CONFIG.image_token_id, 40, 504, 503, 506]
    processor = AutoImageProcessor.from_pretrained(hf[0])

    def greedy(ids, picture):
        features = processor(images=[picture], return_tensors="pt")
        return greedy_with_transformers(hf[1], ids, dict(
            pixel_values=features["pixel_values"],
            image_position_ids=features["image_position_ids"]), 4)

    check_image_prefill(FAMILY, hf[0], text, 128, greedy, REL)


@pytest.mark.extended
def test_gemma_grpo_on_image_prompts_through_the_command(hf, tmp_path):  # noqa: F811
    """test_image_rl.check_grpo for Gemma 4: rollouts prefill each prompt's image, the
    engine's and the training forward's log-probabilities agree; the reward reads the
    image; 2 steps run."""
    check_grpo(hf, tmp_path, run)
