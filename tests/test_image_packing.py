"""Packed image chats (easylm/data/image_chats.py with segment_ids=True) for Qwen3.5's and
Gemma 4's image-text models, on the tests' tiny random checkpoints saved by transformers
(tests/test_image_chats.py's and tests/test_image_chats_gemma4.py's).

A packed row's per-chat losses = each chat's loss unpacked: the chats' attention, Gemma 4's
two-way attention among an image's tokens and Qwen3.5's gated recurrence stay in their
segment, and each chat's positions (Qwen3.5's multimodal rotary's too) restart at 0.
Tolerance: a chat's mean loss is a mean of log-probabilities the families' parity tests
compare at their REL (Qwen3.5 fp32_rel(128, 70), Gemma 4 fp32_rel(256, 110), derived
there): packed and unpacked run the same fp32 reductions over the same row length, with
other segments' keys masked, so REL bounds their difference too. The negative twin drops
the segment ids (the chats see each other): the second chat's loss moves by far more.
Rotary attention depends on position differences only, so positions that do not restart
(a constant shift per chat) would change the losses by rounding alone: the restart is
asserted on the arrays instead (each segment's positions and rotary positions are its
chat's unpacked ones, the not-restarted twin is not).
"""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_image_chats as qwen
import test_image_chats_gemma4 as gemma
from numerics import assert_close, assert_differs
from test_vision_gemma4 import REL as GEMMA_REL, picture as gemma_picture
from test_vision_qwen3_5 import REL as QWEN_REL, picture

from easylm.data import DatasetFactory
from easylm.data.tokenizer import load_tokenizer


def load(hf, family, path, seq_length, batch_size=1, source="json", **options):
    config = DatasetFactory.get_default_config({
        "type": source, "text_processor": {"chat": True},
        {"json": "json_dataset", "cache": "cache"}[source]: dict(
            path=str(path), seq_length=seq_length, batch_size=batch_size, shuffle=False,
            **options)})
    return DatasetFactory.load_dataset(
        config, load_tokenizer(hf[2]), process_index=0, process_count=1,
        images=family.image_chats(family.hf.read_config(hf[0]), hf[0]))


def batches(data, n):
    out = []
    for batch, _ in data:
        out.append(batch)
        if len(out) == n:
            break
    data.close()
    return out


def chat_losses(forward, params, batch, segment_ids="segment_ids"):
    """Each chat's mean next-token loss in row 0 (a packed row's: by its segment ids; the
    model reads `batch[segment_ids]`)."""
    images = {k: jnp.asarray(batch[k]) for k in ("pixel_values", "patch_grid",
                                                  "patch_segments", "image_tokens",
                                                  "rope_positions") if k in batch}
    chats = batch.get("segment_ids", np.ones_like(batch["input_tokens"]))[0]
    packed = segment_ids in batch
    logits = forward(params, jnp.asarray(batch["input_tokens"]),
                     jnp.asarray(batch["positions"]) if packed else None,
                     jnp.asarray(batch[segment_ids]) if packed else None,
                     images=images).logits
    logps = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32)))
    nll = -np.take_along_axis(logps, batch["target_tokens"][0][:, None], 1)[:, 0]
    masks = batch["loss_masks"][0]
    return [float((nll * masks)[chats == s].sum() / masks[chats == s].sum())
            for s in range(1, chats.max() + 1)]


def check_packing(hf, family, rel, tmp_path, rows, pictures):
    """Chats a, b, c (`rows`) packed into rows of len(a) + len(b) tokens: [a, b], then c
    and the next epoch's a; each segment holds its chat's unpacked tokens and positions (restarted: the
    twin that runs on is not); per-chat losses = unpacked; the leaking twin misses."""
    path = qwen.write_data(tmp_path, rows, pictures)
    whole = load(hf, family, path, 400)
    docs = whole.processor.process([(row, f"{path}:{i + 1}") for i, row in enumerate(rows)])
    whole.close()
    T = len(docs[0][0]) + len(docs[1][0]) - 1   # a row of T + 1 tokens holds a and b
    unpacked = batches(load(hf, family, path, T), 3)
    packed = batches(load(hf, family, path, T, segment_ids=True), 2)
    segments = packed[0]["segment_ids"][0]
    assert segments.max() == 2 and segments.min() == 1   # a and b fill the row
    c = packed[1]["segment_ids"][0] == 1   # c starts the next row (then a, epoch 2)
    for key in ("input_tokens", "image_tokens"):
        np.testing.assert_array_equal(packed[1][key][0][c], unpacked[2][key][0][:c.sum()])
    assert (packed[0]["image_tokens"] >= 0).sum() == \
        sum((b["image_tokens"] >= 0).sum() for b in unpacked[:2])
    for s, chat in ((1, unpacked[0]), (2, unpacked[1])):
        m = (segments == s).sum()
        np.testing.assert_array_equal(packed[0]["input_tokens"][0][segments == s],
                                      chat["input_tokens"][0][:m])
        np.testing.assert_array_equal(packed[0]["positions"][0][segments == s],
                                      np.arange(m))
        if "rope_positions" in chat:
            np.testing.assert_array_equal(packed[0]["rope_positions"][0][segments == s],
                                          chat["rope_positions"][0][:m])
    if "rope_positions" in packed[0]:   # the twin whose rotary positions run on
        reader = family.image_chats(family.hf.read_config(hf[0]), hf[0])
        run_on = reader.batch_inputs(list(packed[0]["input_tokens"]),
                                     [docs[0][2] + docs[1][2]], T)["rope_positions"]
        m = (segments == 2).sum()
        assert not np.array_equal(run_on[0][segments == 2], unpacked[1]["rope_positions"][0][:m])

    config = family.hf.read_config(hf[0])
    params = family.hf.read_params(hf[0], config)
    forward = jax.jit(family.bind(config).forward)
    expected = [chat_losses(forward, params, b)[0] for b in unpacked]
    got = chat_losses(forward, params, packed[0]) + chat_losses(forward, params, packed[1])[:1]
    assert_close(np.asarray(got), np.asarray(expected), rel)
    leaky = dict(packed[0], one_document=np.ones_like(packed[0]["segment_ids"]))
    twin = chat_losses(forward, params, leaky, "one_document")
    assert_differs(np.asarray(twin[1:]), np.asarray(expected[1:2]), rel)
    return path, T, packed


@pytest.fixture(scope="module")
def qwen_hf(tmp_path_factory):
    return qwen.saved_checkpoint(tmp_path_factory.mktemp("qwen3_5_vl_packing"))


@pytest.fixture(scope="module")
def gemma_hf(tmp_path_factory):
    return gemma.saved_checkpoint(tmp_path_factory.mktemp("gemma4_vl_packing"))


def test_packed_qwen_image_chats_keep_each_chats_loss(qwen_hf, tmp_path, capsys):
    """Qwen3.5: per-chat losses of packed rows = unpacked; a token cache of the chats
    packs to the same batches bit for bit; the preview counts the packed chats."""
    from easylm.qwen3_5.vision_hf import FAMILY

    rows = [qwen.chat_row("a.png"), qwen.chat_row("b.png", answer="w5 w6"),
            qwen.chat_row("c.png", question="w44")]
    pictures = {"a.png": picture(0, 24, 16), "b.png": picture(1, 16, 32),
                "c.png": picture(2, 16, 16)}
    path, T, packed = check_packing(qwen_hf, FAMILY, QWEN_REL, tmp_path, rows, pictures)
    qwen.build_cache(qwen_hf, path, tmp_path / "cache", capsys)
    cached = batches(load(qwen_hf, FAMILY, tmp_path / "cache", T, source="cache",
                          segment_ids=True), 2)
    for got, expected in zip(cached, packed):
        assert got.keys() == expected.keys()
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key])
    from easylm.data import preview

    with contextlib.redirect_stdout(io.StringIO()) as out:
        preview.main(["preview", "--family=qwen3_5_vl", f"--load_checkpoint=hf::{qwen_hf[0]}",
                      f"--tokenizer={qwen_hf[2]}", "--train_dataset.text_processor.chat=True",
                      "--train_dataset.type=cache", f"--train_dataset.cache.path={tmp_path}/cache",
                      "--num_batches=2", f"--train_dataset.cache.seq_length={T}",
                      "--train_dataset.cache.batch_size=1", "--train_dataset.cache.shuffle=False",
                      "--train_dataset.cache.segment_ids=True"])
    text = out.getvalue()
    assert f"2 batches of 1 x {T} tokens, packed: 4 chats in 2 rows" in text, text  # a, b | c, a
    assert "images: 4, image tokens: 24" in text, text


def test_packed_gemma_image_chats_keep_each_chats_loss(gemma_hf, tmp_path):
    """Gemma 4: per-chat losses of packed rows = unpacked, each image's two-way attention
    inside its own chat."""
    from easylm.gemma4.vision_hf import FAMILY

    rows = [qwen.chat_row("a.png"), qwen.chat_row("b.png", answer="w5 w6"),
            qwen.chat_row("c.png", question="w44")]
    pictures = {"a.png": gemma_picture(0, 16, 24), "b.png": gemma_picture(1, 32, 32),
                "c.png": gemma_picture(2, 16, 16)}
    check_packing(gemma_hf, FAMILY, GEMMA_REL, tmp_path, rows, pictures)
