"""The shipped corpus and tokenizer are exactly what the code in the repo generates."""

import json

from easylm.data import embedded
from easylm.data.embedded.generate import generate
from easylm.data.tokenizer import load_tokenizer


def test_regeneration_is_byte_identical(tmp_path):
    corpus, tokenizer = tmp_path / "corpus.jsonl", tmp_path / "tokenizer.json"
    generate(str(corpus), str(tokenizer))
    with open(embedded.CORPUS_PATH, "rb") as f:
        assert corpus.read_bytes() == f.read()
    with open(embedded.TOKENIZER_PATH, "rb") as f:
        assert tokenizer.read_bytes() == f.read()


def test_corpus_and_tokenizer_fit_together():
    with open(embedded.CORPUS_PATH) as f:
        texts = [json.loads(line)["text"] for line in f]
    assert len(texts) == embedded.NUM_DOCUMENTS and len(set(texts)) > 0.9 * len(texts)
    tokenizer = load_tokenizer("embedded")
    assert len(tokenizer) == embedded.VOCAB_SIZE == 512     # the debug preset's vocab
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    ids = tokenizer.encode(texts[0])
    assert ids[0] == 1 and tokenizer.decode(ids[1:]) == texts[0]
