"""EasyLM's field syntax, chat masking and JSON-line parsing, checked token by token."""

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from easylm.data import embedded
from easylm.data.text import TextProcessor, parse_fields, parse_json_line
from easylm.data.tokenizer import load_tokenizer
from easylm.errors import UserError

BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def process(tokenizer, example, where="data.jsonl:1", **config):
    [result] = TextProcessor(config, tokenizer).process([(example, where)])
    return result


def test_prompt_gets_no_loss_answer_does(tokenizer):
    example = {"prompt": "What is two plus two?", "answer": "Four."}
    tokens, masks = process(tokenizer, example, fields="[prompt],answer")
    prompt, answer = encode(tokenizer, example["prompt"]), encode(tokenizer, example["answer"])
    assert tokens.tolist() == [BOS] + prompt + answer + [EOS]
    assert masks.tolist() == [0.0] * (1 + len(prompt)) + [1.0] * (len(answer) + 1)
    assert tokens.dtype == np.int32 and masks.dtype == np.float32


def test_subfields_join_with_separator(tokenizer):
    example = {"instruction": "Name three animals", "input": "cat", "output": "dog"}
    tokens, masks = process(tokenizer, example, fields="[instruction+input],output",
                            subfield_separator="\n")
    joined = encode(tokenizer, "Name three animals\ncat")
    output = encode(tokenizer, "dog")
    assert tokens.tolist() == [BOS] + joined + output + [EOS]
    assert masks.tolist() == [0.0] * (1 + len(joined)) + [1.0] * (len(output) + 1)


def test_special_markers_and_no_bos_eos(tokenizer):
    example = {"a": "Hi", "b": "there"}
    tokens, masks = process(tokenizer, example, fields="[<|bos|>],[a],<|eos|>,b,<|5|>",
                            add_bos_token=False, add_eos_token=False)
    a, b = encode(tokenizer, "Hi"), encode(tokenizer, "there")
    assert tokens.tolist() == [BOS] + a + [EOS] + b + [5]
    assert masks.tolist() == [0.0] * (1 + len(a)) + [1.0] * (1 + len(b) + 1)


def test_prepend_text_and_fields_from_example(tokenizer):
    example = {"spec": "[q],a", "q": "Why?", "a": "Because."}
    tokens, masks = process(tokenizer, example, fields_from_example="spec",
                            prepend_text="Q: ")
    q, a = encode(tokenizer, "Q: Why?"), encode(tokenizer, "Because.")
    assert tokens.tolist() == [BOS] + q + a + [EOS]
    assert masks.tolist() == [0.0] * (1 + len(q)) + [1.0] * (len(a) + 1)


def test_parse_fields():
    assert parse_fields("[a+b],<|eos|>,c") == (
        (("a", "b"), None, 0.0), ((), "eos", 1.0), (("c",), None, 1.0))


def test_missing_field_names_field_and_line(tokenizer):
    with pytest.raises(UserError) as e:
        process(tokenizer, {"prompt": "x", "output": "y"}, where="sft.jsonl:7",
                fields="[prompt],answer")
    assert str(e.value) == ("sft.jsonl:7: missing field 'answer' (fields='[prompt],answer'); "
                            "the example has: prompt, output")


def test_field_that_is_not_text(tokenizer):
    with pytest.raises(UserError) as e:
        process(tokenizer, {"text": ["a"]}, where="d.jsonl:2")
    assert str(e.value) == "d.jsonl:2: field 'text' is list, expected text"


def test_bad_field_specs(tokenizer):
    with pytest.raises(UserError) as e:
        TextProcessor({"fields": "a,,b"}, tokenizer)
    assert str(e.value) == "text_processor.fields='a,,b': field 2 ('') has an empty name"
    with pytest.raises(UserError) as e:
        process(tokenizer, {"a": "x"}, fields="a,<|sep|>")
    assert str(e.value) == ("<|sep|> in text_processor.fields: the tokenizer has no such "
                            "token; use <|bos|>, <|eos|> or a token id like <|2|>")
    with pytest.raises(UserError) as e:
        TextProcessor({"fields": ""}, tokenizer)
    assert "are both empty" in str(e.value)


def test_tokenizer_without_bos(tokenizer):
    bare = PreTrainedTokenizerFast(tokenizer_file=embedded.TOKENIZER_PATH)
    with pytest.raises(UserError) as e:
        TextProcessor({"add_bos_token": "true"}, bare)
    assert str(e.value) == ("text_processor.add_bos_token=True but the tokenizer has no BOS "
                            "token; set text_processor.add_bos_token=False")
    with pytest.raises(UserError) as e:  # auto asks for no BOS it has not got
        TextProcessor(None, bare)
    assert str(e.value).startswith("text_processor.add_eos_token=True")


def test_empty_text_is_a_skip_reason(tokenizer):
    assert process(tokenizer, {"text": ""}, where="d.jsonl:4") == "d.jsonl:4: empty text"
    # Blank lines (None) and reader errors (str) pass through untouched.
    processor = TextProcessor(None, tokenizer)
    assert processor.process([(None, "d:1"), ("d:2: bad", "d:2")]) == [None, "d:2: bad"]


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Bye now."},
]


def test_chat_masks_everything_but_assistant_turns(tokenizer):
    tokens, masks = process(tokenizer, {"messages": CONVERSATION}, chat=True)
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokens.tolist() == encode(tokenizer, text)
    # Runs of trained tokens, decoded: exactly the two replies with their EOS.
    runs, run = [], []
    for token, mask in zip(tokens.tolist(), masks.tolist()):
        if mask:
            run.append(token)
        elif run:
            runs.append(tokenizer.decode(run))
            run = []
    runs += [tokenizer.decode(run)] if run else []
    assert runs == ["Hello.</s>\n", "Bye now.</s>\n"]
    untrained = tokenizer.decode(tokens[masks == 0])
    assert "Hello." not in untrained and "Bye now." not in untrained
    assert "<|assistant|>" in untrained and "Be brief." in untrained


def test_chat_with_given_template(tokenizer, tmp_path):
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    path = tmp_path / "template.jinja"
    path.write_text(template)
    for given in (template, str(path)):
        tokens, masks = process(tokenizer, {"messages": CONVERSATION[1:3]}, chat=True,
                                chat_template=given)
        assert tokenizer.decode(tokens) == "user: Hi\nassistant: Hello.\n"
        assert tokenizer.decode(tokens[masks == 1]) == "Hello.\n"


def test_chat_bad_inputs(tokenizer):
    assert process(tokenizer, {"messages": CONVERSATION[:2]}, where="c.jsonl:3",
                   chat=True) == "c.jsonl:3: no assistant message, so nothing to train on"
    with pytest.raises(UserError) as e:
        process(tokenizer, {"messages": [{"role": "user"}]}, where="c.jsonl:4", chat=True)
    assert str(e.value) == ('c.jsonl:4: \'messages\' must be a list of {"role": str, '
                            '"content": str} objects')
    with pytest.raises(UserError) as e:
        process(tokenizer, {"text": "x"}, where="c.jsonl:5", chat=True)
    assert str(e.value) == ("c.jsonl:5: missing field 'messages' (text_processor.chat=True); "
                            "the example has: text")
    unstable = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages | length }}"
    with pytest.raises(UserError) as e:
        process(tokenizer, {"messages": CONVERSATION[1:3]}, where="c.jsonl:6", chat=True,
                chat_template=unstable)
    assert str(e.value).startswith("c.jsonl:6: the chat template renders")


def test_parse_json_line():
    assert parse_json_line(b'{"text": "hi"}', "d:1") == {"text": "hi"}
    assert parse_json_line(b"  ", "d:2") is None
    assert parse_json_line(b'{"text": ', "d:3") == (
        "d:3: malformed JSON (Expecting value at column 10)")
    assert parse_json_line(b'{"text": "caf\xe9"}', "d:4") == (
        "d:4: not valid UTF-8 (byte 0xe9 at column 14)")
    assert parse_json_line(b"[1, 2]", "d:5") == "d:5: expected a JSON object, got list"


def byte_level_bpe():
    """A SmolLM2-like tokenizer: ByteLevel BPE whose `tokenizer(text)` adds no special
    token, though it names a BOS (<|endoftext|>, as SmolLM2's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["the cat sat on the mat", "a dog ran far"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=[
                                "<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>")


def test_bos_follows_the_tokenizer_by_default(tokenizer):
    # The trainer's ids of a text document are the tokenizer's own, then EOS: no BOS the
    # tokenizer does not add (every SmolLM2 document used to start with one), and the
    # LLaMA-style tokenizer's BOS kept. add_bos_token=true is the old behaviour.
    text = "the cat sat on the mat"
    for tok in (byte_level_bpe(), tokenizer):
        tokens, masks = process(tok, {"text": text})
        assert tokens.tolist() == tok(text)["input_ids"] + [tok.eos_token_id]
        forced, _ = process(tok, {"text": text}, add_bos_token="true")
        assert forced.tolist() == [tok.bos_token_id] + encode(tok, text) + [tok.eos_token_id]
    bpe = byte_level_bpe()
    assert bpe(text)["input_ids"][0] != bpe.bos_token_id  # the negative twin: they differ
    assert tokenizer(text)["input_ids"][0] == BOS
    old, _ = process(tokenizer, {"text": text}, add_bos_token=True)  # a bool, as it was
    assert old.tolist() == tokenizer(text)["input_ids"] + [EOS]
    with pytest.raises(UserError, match="add_bos_token must be auto, true or false, got 'no'"):
        process(tokenizer, {"text": text}, add_bos_token="no")
