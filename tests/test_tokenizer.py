"""load_tokenizer: the embedded one, HF directories, tokenizer.json, SentencePiece, errors."""

import shutil

import pytest

from easylm.data import embedded
from easylm.data.tokenizer import load_tokenizer
from easylm.errors import UserError

TEXT = "Once upon a time, there was a brave owl named Lily."


def test_embedded_round_trips():
    tokenizer = load_tokenizer("embedded")
    ids = tokenizer.encode(TEXT)
    assert ids[0] == tokenizer.bos_token_id == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt == "<s><|user|>\nHi</s>\n<|assistant|>\n"


def test_directory_and_bare_json(tmp_path):
    reference = load_tokenizer("embedded")
    reference.save_pretrained(tmp_path / "dir")
    from_dir = load_tokenizer(str(tmp_path / "dir"))
    assert from_dir.encode(TEXT) == reference.encode(TEXT)
    assert from_dir.chat_template == reference.chat_template
    (tmp_path / "bare").mkdir()
    shutil.copy(embedded.TOKENIZER_PATH, tmp_path / "bare" / "tokenizer.json")
    bare = load_tokenizer(str(tmp_path / "bare" / "tokenizer.json"))
    assert bare.encode(TEXT) == reference.encode(TEXT)
    assert (bare.bos_token_id, bare.eos_token_id, bare.pad_token_id) == (1, 2, 0)


def test_sentencepiece_model(tmp_path):
    import sentencepiece as spm

    from easylm.data.embedded.stories import documents

    (tmp_path / "text.txt").write_text("\n".join(documents(300)))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=200,
        model_type="bpe", bos_id=1, eos_id=2, unk_id=0, minloglevel=2)
    tokenizer = load_tokenizer(str(tmp_path / "sp.model"))
    processor = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert tokenizer.encode(TEXT, add_special_tokens=False) == processor.encode(TEXT)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


def test_errors(tmp_path):
    expected = ("expected 'embedded', a tokenizer directory, a tokenizer.json file or a "
                "SentencePiece .model file")
    with pytest.raises(UserError) as e:
        load_tokenizer(str(tmp_path / "missing"))
    assert str(e.value) == f"tokenizer '{tmp_path}/missing' does not exist; {expected}"
    with pytest.raises(UserError) as e:
        load_tokenizer(str(tmp_path))
    assert str(e.value) == (f"tokenizer directory '{tmp_path}' has none of tokenizer.json, "
                            f"tokenizer.model, tokenizer_config.json")
    (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises(UserError) as e:
        load_tokenizer(str(tmp_path / "vocab.txt"))
    assert str(e.value) == (f"tokenizer '{tmp_path}/vocab.txt' is a file but not .json or "
                            f".model; {expected}")
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(UserError) as e:
        load_tokenizer(str(tmp_path / "broken.json"))
    assert str(e.value).startswith(f"cannot read tokenizer file '{tmp_path}/broken.json'")
