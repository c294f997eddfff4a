"""DPO and GRPO on prompts with images (Qwen3.5's image-text model) through
`python -m easylm.train`, against transformers' Qwen3_5ForConditionalGeneration saved tiny
and random in the test (tests/test_image_chats.py's checkpoint, processor and tokenizer).

Tolerance: the logged log-probabilities are sums over a handful of response tokens of the
log-probabilities test_vision_qwen3_5.py compares at REL (fp32_rel(128, 70), derived
there): REL of the largest again.
"""

import contextlib
import io
import json
import math

import numpy as np
import torch
from PIL import Image
from numerics import assert_close, assert_differs
from test_image_chats import hf, transformers_inputs, write_data  # noqa: F401 (hf: fixture)
from test_vision_qwen3_5 import REL, picture

T = 40


def pair_row(image, chosen="w77 w78", rejected="w5 w6 w7"):
    """A preference pair whose prompt (one user message) holds an image; the replies
    are strings after it."""
    return {"prompt": [{"role": "user", "content": [{"type": "image", "image": image},
                                                    {"type": "text", "text": "w40 w41"}]}],
            "chosen": chosen, "rejected": rejected}


def run(hf, data, output_dir, steps, *flags):  # noqa: F811 (hf: the fixture's value)
    """The metrics rows of `python -m easylm.train` on `data` (fp32, batch 1, lr 1e-2)."""
    from easylm import train as command

    with contextlib.redirect_stdout(io.StringIO()):
        command.main(["train", "--family=qwen3_5_vl", f"--load_checkpoint=hf::{hf[0]}",
                      f"--tokenizer={hf[2]}", f"--total_steps={steps}", "--log_freq=1",
                      "--dtype=fp32", "--mesh_dim=1,1,-1", "--compilation_cache_dir=",
                      "--train_dataset.text_processor.chat=True",
                      f"--train_dataset.json_dataset.path={data}",
                      f"--train_dataset.json_dataset.seq_length={T}",
                      "--train_dataset.json_dataset.batch_size=1",
                      f"--logger.output_dir={output_dir}", "--logger.experiment_id=run",
                      "--optimizer.adamw_optimizer.lr=1e-2",
                      "--optimizer.adamw_optimizer.lr_warmup_steps=0",
                      # the rows' images together: 24 patches (6 image tokens)
                      "--qwen3_5_vl.max_image_patches=32", *flags])
    with open(f"{output_dir}/run/metrics.jsonl") as f:
        return [row for row in map(json.loads, f) if "loss" in row]


def reply_logps(hf, image, reply: str) -> float:  # noqa: F811
    """transformers' summed log-probability of `reply` (and its <|im_end|>) after
    pair_row's prompt with `image`, the chat rendered by the tokenizer's template."""
    messages = pair_row("x")["prompt"] + [{"role": "assistant", "content": reply}]
    ids, start, vision = transformers_inputs(hf, image, messages)
    with torch.no_grad():
        logits = hf[1](input_ids=ids, **vision).logits.double()
    logps = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    # The targets from the reply on, to its <|im_end|> (the rendered chat's last token).
    return float(logps[start - 1:].sum())


def test_dpo_on_image_prompts_through_the_command(hf, tmp_path):  # noqa: F811
    """Step 1's log-probabilities of chosen and rejected = transformers' on the same chats
    and image (another image: differs), so its loss is DPO's with the reference = the
    policy: log 2, exactly; 3 steps lower it and the margin grows."""
    path = write_data(tmp_path, [pair_row("a.png")], {"a.png": picture(0, 24, 16)})
    rows = run(hf, path, tmp_path / "out", 3, "--objective=dpo")
    got = np.asarray([rows[0]["logps/chosen"], rows[0]["logps/rejected"]])
    want = np.asarray([reply_logps(hf, picture(0, 24, 16), "w77 w78"),
                       reply_logps(hf, picture(0, 24, 16), "w5 w6 w7")])
    assert_close(got, want, REL)
    assert_differs(got, np.asarray([reply_logps(hf, picture(5, 24, 16), "w77 w78"),
                                    reply_logps(hf, picture(5, 24, 16), "w5 w6 w7")]), REL)
    # DPO (Rafailov et al. 2023, eq. 7) from transformers' log-probabilities, beta 0.1:
    # the reference is the starting policy, so h = 0.
    beta = 0.1
    h = beta * ((want[0] - want[0]) - (want[1] - want[1]))
    assert math.isclose(rows[0]["loss"], -math.log(1 / (1 + math.exp(-h))), rel_tol=1e-6)
    assert rows[-1]["loss"] < rows[0]["loss"], [row["loss"] for row in rows]
    assert rows[-1]["rewards/margin"] > 0


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


def test_grpo_on_image_prompts_through_the_command(hf, tmp_path):  # noqa: F811
    """Rollouts prefill each prompt's image: the engine's log-probabilities of the
    sampled tokens = the training forward's on the same rows and images (sampler_logp_diff,
    temperature 1: fp32 sums of REL order); the reward reads the image; 2 steps run."""
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
