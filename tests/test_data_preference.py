"""Preference pairs: masks on the responses only, both sides in one row, truncation, exact
resume across process counts, bad pairs, chat formats, the preview."""

import itertools
import json
import logging

import numpy as np
import pytest
from data_utils import assert_same, encode, load, read, tokenizer  # noqa: F401 (a fixture)

from easylm.data import DatasetFactory, merge_state_dicts
from easylm.data.embedded.stories import documents
from easylm.data.pairs import PreferenceProcessor
from easylm.data.preview import preview
from easylm.errors import UserError

T, B = 48, 4
BOS, EOS = 1, 2


def process(tokenizer, example, where="p.jsonl:1", seq_length=T, preference=None, **text):
    processor = PreferenceProcessor(
        preference, DatasetFactory.get_default_config({"text_processor": text}).text_processor,
        tokenizer, seq_length)
    [result] = processor.process([(example, where)])
    return result


def trained(tokenizer, tokens, masks):
    return tokenizer.decode(tokens[masks > 0])


PAIR = {"prompt": "What does a cat say?", "chosen": "Meow.", "rejected": "Woof woof."}


def test_text_pairs_train_only_the_responses(tokenizer):
    chosen, chosen_masks, rejected, rejected_masks, truncated = process(tokenizer, PAIR)
    prompt = [BOS] + encode(tokenizer, PAIR["prompt"])
    assert chosen.tolist() == prompt + encode(tokenizer, "Meow.") + [EOS]
    assert rejected.tolist() == prompt + encode(tokenizer, "Woof woof.") + [EOS]
    assert chosen_masks.tolist() == [0] * len(prompt) + [1] * (len(chosen) - len(prompt))
    assert rejected_masks.tolist() == [0] * len(prompt) + [1] * (len(rejected) - len(prompt))
    assert not truncated
    # A tokenizer that adds no BOS (or a run that adds none), other field names.
    renamed = {"question": PAIR["prompt"], "good": "Meow.", "bad": "Woof woof."}
    chosen, chosen_masks, *_ = process(
        tokenizer, renamed, add_bos_token="false", add_eos_token=False,
        preference=dict(prompt_field="question", chosen_field="good", rejected_field="bad"))
    assert chosen.tolist() == encode(tokenizer, PAIR["prompt"]) + encode(tokenizer, "Meow.")
    assert trained(tokenizer, chosen, chosen_masks) == "Meow."


CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "What does a cat say?"}]


def test_chat_pairs_in_each_format_train_only_the_replies(tokenizer):
    reply = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    formats = [
        # UltraFeedback-binarized: whole conversations; `prompt` (the last question) unused
        {"prompt": "What does a cat say?", "chosen": CONVERSATION + reply("Meow."),
         "rejected": CONVERSATION + reply("Woof woof.")},
        {"prompt": CONVERSATION, "chosen": "Meow.", "rejected": "Woof woof."},
        {"prompt": CONVERSATION, "chosen": reply("Meow."), "rejected": reply("Woof woof.")},
    ]
    results = [process(tokenizer, example, chat=True) for example in formats]
    for result in results[1:]:
        for got, want in zip(result[:4], results[0][:4]):
            np.testing.assert_array_equal(got, want)
    chosen, chosen_masks, rejected, rejected_masks, _ = results[0]
    text = tokenizer.apply_chat_template(CONVERSATION + reply("Meow."), tokenize=False)
    assert chosen.tolist() == encode(tokenizer, text)
    # Only the reply after the shared conversation: not the earlier "Hello.".
    assert trained(tokenizer, chosen, chosen_masks) == "Meow.</s>\n"
    assert trained(tokenizer, rejected, rejected_masks) == "Woof woof.</s>\n"
    # A prompt given as text is one user message.
    chosen, chosen_masks, *_ = process(tokenizer, PAIR, chat=True)
    messages = [{"role": "user", "content": PAIR["prompt"]}] + reply("Meow.")
    assert chosen.tolist() == encode(tokenizer, tokenizer.apply_chat_template(messages,
                                                                              tokenize=False))


@pytest.mark.parametrize("example, chat, message", [
    ({"prompt": "a", "chosen": "b"}, False,
     "missing field 'rejected'; the example has: prompt, chosen"),
    ({"prompt": "a", "chosen": "b", "rejected": "b"}, False, "chosen and rejected are the same"),
    ({"prompt": "a", "chosen": 3, "rejected": "b"}, False,
     "field 'chosen' is int, expected text (or set text_processor.chat=True for messages)"),
    ({"prompt": ["a"], "chosen": "b", "rejected": "c"}, False,
     "field 'prompt' is list, expected text (or set text_processor.chat=True for messages)"),
    ({"prompt": " ".join(["cat"] * T), "chosen": "b", "rejected": "c"}, False,   # BOS, 49
     f"the prompt is {T + 2} tokens, longer than seq_length={T}"),
    ({"prompt": "a", "chosen": "", "rejected": "c"}, False,   # with add_eos_token=False
     "the chosen response has no tokens to train on"),
    ({"chosen": [{"role": "user"}], "rejected": "c"}, True,
     "field 'chosen' must be text or a non-empty list of {\"role\": str, \"content\": str} "
     "objects"),
    ({"chosen": "b", "rejected": "c"}, True,
     "missing field 'prompt' (chosen and rejected hold only the replies); the example has: "
     "chosen, rejected"),
    ({"chosen": CONVERSATION[:2], "rejected": CONVERSATION[:1] + CONVERSATION[3:]}, True,
     "chosen and rejected differ at message 2, which is a 'user' message, not an assistant "
     "reply"),
    ({"chosen": CONVERSATION[:3], "rejected": CONVERSATION[:2]}, True,
     "the rejected conversation has no reply after the 2 messages it shares with the other"),
])
def test_bad_pairs_name_their_line(tokenizer, example, chat, message):
    assert process(tokenizer, example, where="p.jsonl:7", chat=chat,
                   add_eos_token=False) == f"p.jsonl:7: {message}"


def pairs(n, seed=0):
    """Pairs of embedded stories: a prompt, and two responses of unequal lengths."""
    texts = list(documents(3 * n, seed=seed))
    return [{"prompt": texts[3 * i][:60], "chosen": texts[3 * i + 1][:40 + i % 50],
             "rejected": texts[3 * i + 2][:30 + 2 * i % 70]} for i in range(n)]


def write(path, examples):
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


def config(path, **loader):
    return DatasetFactory.get_default_config({
        "preference": {"enabled": True},
        "json_dataset": dict(dict(path=str(path), seq_length=T, batch_size=B,
                                  tokenizer_parallel_batch_size=8), **loader)})


def test_batches_hold_both_sides_of_each_pair_in_one_row(tmp_path, tokenizer):
    examples = pairs(12)
    [dataset] = load(config(write(tmp_path / "p.jsonl", examples)), tokenizer, pairs=True)
    [batch], [metrics] = read([dataset], 1, with_metrics=True)
    assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
        f"{side}_{k}": ((B, T), dtype) for side in ("chosen", "rejected")
        for k, dtype in (("input_tokens", "int32"), ("target_tokens", "int32"),
                         ("loss_masks", "float32"))}
    for i in range(B):   # row i holds pair i: its prompt on both sides, its two responses
        want = process(tokenizer, examples[i])
        for side, tokens, masks in (("chosen", *want[:2]), ("rejected", *want[2:4])):
            n = len(tokens) - 1
            assert batch[f"{side}_input_tokens"][i, :n].tolist() == tokens[:-1].tolist()
            assert batch[f"{side}_target_tokens"][i, :n].tolist() == tokens[1:].tolist()
            assert batch[f"{side}_loss_masks"][i].tolist() == masks[1:].tolist() + [0] * (T - n)
    assert metrics["dataset_total_tokens"] == 2 * B * T


def test_truncation_keeps_the_prompt_cuts_the_responses_and_is_counted(tmp_path, tokenizer):
    long = " ".join(documents(3, seed=5))
    examples = [dict(PAIR, chosen=long), PAIR, dict(PAIR, rejected=long), PAIR]
    [dataset] = load(config(write(tmp_path / "p.jsonl", examples), batch_size=2), tokenizer,
                     pairs=True)
    batches, [metrics] = read([dataset], 2, with_metrics=True)
    prompt = [BOS] + encode(tokenizer, PAIR["prompt"])
    cut = (prompt + encode(tokenizer, long))[1:T + 1]   # the targets of a full row
    assert batches[0]["chosen_target_tokens"][0].tolist() == cut
    assert batches[0]["chosen_loss_masks"][0].tolist() == [0] * (len(prompt) - 1) + \
        [1] * (T - len(prompt) + 1)
    assert batches[1]["rejected_target_tokens"][0].tolist() == cut
    assert metrics["dataset_truncated_pairs"] == 2


@pytest.mark.parametrize("shuffle, before, after", [(True, 2, 1), (False, 1, 2)])
def test_resume_gives_the_uninterrupted_batches(tmp_path, tokenizer, shuffle, before, after):
    examples = pairs(30)
    examples[4] = dict(examples[4], chosen=examples[4]["rejected"])   # skipped
    examples[9] = dict(examples[9], chosen=" ".join(documents(2)))   # truncated
    cfg = config(write(tmp_path / "p.jsonl", examples), shuffle=shuffle, seed=3)
    n, m = 5, 12   # 17 batches of 4 pairs: past the 29 usable pairs, into epoch 2
    expected, expected_metrics = read(load(cfg, tokenizer, pairs=True), n + m,
                                      with_metrics=True)
    first = load(cfg, tokenizer, before, pairs=True)
    got = read(first, n)
    state = json.loads(json.dumps(merge_state_dicts([d.get_state_dict() for d in first])))
    assert state["pairs"] and state["batches"] == n
    second = load(cfg, tokenizer, after, pairs=True)
    for d in second:
        d.load_state_dict(state)
    more, metrics = read(second, m, with_metrics=True)
    assert_same(expected, got + more)
    # The truncated-pairs counter continues too: the processes' rows add up to it.
    assert sum(x["dataset_truncated_pairs"] for x in metrics) == \
        expected_metrics[0]["dataset_truncated_pairs"] >= 2


def test_eval_is_one_pass_over_every_pair_with_empty_rows_at_the_end(tmp_path, tokenizer):
    examples = pairs(6)
    batches = [b for b, _ in load(config(write(tmp_path / "p.jsonl", examples)), tokenizer,
                                  pairs=True, for_eval=True)[0]]
    assert len(batches) == 2
    last = batches[-1]
    assert last["chosen_loss_masks"][:2].any(axis=1).all()
    assert not last["chosen_loss_masks"][2:].any() and not last["rejected_loss_masks"][2:].any()


def test_bad_pairs_are_skipped_with_warnings_or_fail_with_strict(tmp_path, tokenizer, caplog):
    good = pairs(3)
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([json.dumps(good[0]), '{"prompt": ',
                               json.dumps(dict(good[1], rejected=good[1]["chosen"])),
                               json.dumps(good[2])]) + "\n")
    [dataset] = load(config(path, batch_size=1), tokenizer, pairs=True)
    with caplog.at_level(logging.WARNING, logger="easylm.data.dataset"):
        batches = list(itertools.islice(dataset, 3))
    assert sorted({r.getMessage() for r in caplog.records
                   if r.name == "easylm.data.dataset"}) == [
        f"skipped {path}:2: malformed JSON (Expecting value at column 12)",
        f"skipped {path}:3: chosen and rejected are the same"]
    assert batches[-1][1]["dataset_skipped_documents"] >= 2
    [dataset] = load(config(path, batch_size=1, strict=True), tokenizer, pairs=True)
    with pytest.raises(UserError) as e:
        list(itertools.islice(dataset, 3))
    assert str(e.value) == f"{path}:2: malformed JSON (Expecting value at column 12)"


def test_huggingface_chat_pairs_equal_the_json_ones(tmp_path, tokenizer):
    import datasets

    reply = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    examples = [{"prompt": e["prompt"], "chosen": CONVERSATION + reply(e["chosen"]),
                 "rejected": CONVERSATION + reply(e["rejected"])} for e in pairs(8)]
    datasets.Dataset.from_list(examples).save_to_disk(str(tmp_path / "saved"))
    loader = dict(seq_length=T, batch_size=B, shuffle=True, tokenizer_parallel_batch_size=8)
    from_json = config(write(tmp_path / "p.jsonl", examples), shuffle=True)
    from_hf = DatasetFactory.get_default_config({
        "type": "huggingface", "preference": {"enabled": True},
        "huggingface_dataset": dict(loader, path=str(tmp_path / "saved"))})
    for cfg in (from_json, from_hf):
        cfg.text_processor.chat = True
    want = read(load(from_json, tokenizer, pairs=True), 3)
    assert_same(want, read(load(from_hf, tokenizer, pairs=True), 3))
    text = trained(tokenizer, want[0]["chosen_target_tokens"][0], want[0]["chosen_loss_masks"][0])
    assert text and any(e["chosen"][-1]["content"].startswith(text) for e in examples)


def test_config_errors(tmp_path, tokenizer):
    path = write(tmp_path / "p.jsonl", pairs(4))
    cases = {
        (): "--train_dataset.preference.enabled=True makes batches of preference pairs, which "
            "only a preference objective trains on; this command trains next-token prediction",
        (("segment_ids", True),): "segment_ids=True: preference pairs are not packed (one pair "
                                  "per row), so there are no segments; set it to False",
    }
    for loader, message in cases.items():
        with pytest.raises(UserError) as e:
            load(config(path, **dict(loader)), tokenizer, pairs=bool(loader))
        assert str(e.value) == message
    cfg = DatasetFactory.get_default_config({"type": "mixture", "preference": {"enabled": True}})
    with pytest.raises(UserError) as e:
        load(cfg, tokenizer, pairs=True)
    assert str(e.value) == ("--train_dataset.preference.enabled=True reads pairs from a json or "
                            "huggingface source, not --train_dataset.type=mixture")
    # A text run's state does not resume pairs, nor the other way round.
    [pair_data] = load(config(path), tokenizer, pairs=True)
    text = DatasetFactory.get_default_config({"json_dataset": dict(
        path=str(tmp_path / "t.jsonl"), seq_length=T, batch_size=B)})
    write(tmp_path / "t.jsonl", [{"text": "Tom had a cat."}])
    [text_data] = load(text, tokenizer)
    with pytest.raises(UserError, match="^the data state was not saved from preference pairs"):
        pair_data.load_state_dict(text_data.get_state_dict())
    with pytest.raises(UserError, match="^the data state was saved from preference pairs"):
        text_data.load_state_dict(pair_data.get_state_dict())


def test_preview_shows_both_sides_with_their_masks(tmp_path, tokenizer):
    examples = [PAIR, dict(PAIR, chosen=" ".join(documents(3, seed=5)))]
    text = preview(config(write(tmp_path / "p.jsonl", examples), batch_size=2), tokenizer,
                   num_examples=1, num_batches=1)
    lines = text.splitlines()
    assert "--- pair 0" in lines
    assert "chosen: [[<s>What does a cat say?]]Meow.</s>" in lines
    assert "rejected: [[<s>What does a cat say?]]Woof woof.</s>" in lines
    assert "1 batches of 2 pairs of 2 x 48 tokens" in lines
    assert "pairs truncated to seq_length: 1" in lines


def test_pairs_tokenized_apart_unlike_whole_are_warned_and_counted(tmp_path, tokenizer, caplog):
    # "cat say? " apart ends in a lone "▁" token; whole, the space joins "Meow." (TRL warns
    # about such pairs too). A pair without the trailing space tokenizes alike both ways.
    spaced = dict(PAIR, prompt=PAIR["prompt"] + " ")
    assert encode(tokenizer, spaced["prompt"]) + encode(tokenizer, "Meow.") != \
        encode(tokenizer, spaced["prompt"] + "Meow.")
    path = write(tmp_path / "p.jsonl", [PAIR, spaced, PAIR])
    with caplog.at_level(logging.WARNING, logger="easylm.data.pairs"):
        text = preview(config(path, batch_size=3), tokenizer, num_examples=0, num_batches=1)
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}:2: the prompt's last token merges with the response's first when tokenized "
        f"together (a prompt ending in a space?); trained apart: the prompt's own tokens, "
        f"then the response's"]
    assert "pairs whose prompt's last token merges with the response's: 1" in text.splitlines()
