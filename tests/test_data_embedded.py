"""The shipped corpus and tokenizer are exactly what the code in the repo generates, and its
chat documents are what the server prompts with."""

import json
import random
import re
from types import SimpleNamespace

from easylm.data import embedded
from easylm.data.embedded import stories
from easylm.data.embedded.generate import generate
from easylm.data.text import TextProcessor
from easylm.data.tokenizer import load_tokenizer
from easylm.serving.service import Service


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


def test_chat_documents_are_what_the_server_prompts_with():
    """A chat document, with the trainer's default BOS and EOS around it, is the chat
    template's rendering token for token; the server's prompt for each assistant turn
    (its own code) is a prefix of it, followed by the reply and EOS."""
    tokenizer = load_tokenizer("embedded")
    processor = TextProcessor(TextProcessor.get_default_config(), tokenizer)
    engine = SimpleNamespace(seq_length=512, model=SimpleNamespace(vocab_size=512))
    service = Service({}, SimpleNamespace(engine=engine), tokenizer)
    conversations = [stories.chat_messages(random.Random(seed)) for seed in range(40)]
    assert {len(m) for m in conversations} == {2, 4}  # one turn and two
    for messages in conversations:
        text = embedded.chat_document(messages)
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        assert "<s>" + text + "</s>\n" == rendered
        ((tokens, masks),) = processor.process([({"text": text}, "chat")])
        assert tokens.tolist() == tokenizer(rendered, add_special_tokens=False)["input_ids"][:-1]
        assert masks[0] == 0 and masks[1:].all()
        for turn in range(1, len(messages), 2):
            prompt = service.apply_chat_template(messages[:turn])
            reply = tokenizer(messages[turn]["content"], add_special_tokens=False)["input_ids"]
            after = tokens[len(prompt):len(prompt) + len(reply) + 1].tolist()
            assert tokens[:len(prompt)].tolist() == prompt and after == reply + [2]


def test_chat_stories_are_about_the_hero_asked_for():
    asked = 0
    for seed in range(200):
        messages = stories.chat_messages(random.Random(seed))
        for ask, answer in zip(messages[::2], messages[1::2]):
            first = answer["content"].split(".")[0]
            assert first.startswith("Once upon a time, there was ")
            match = re.search(r"about (?:an? (\w+))?(?: named )?(\w+)?", ask["content"])
            if match:
                animal, name = match.groups()
                asked += 1
                assert (animal is None or f" {animal} named " in first) and \
                    (name is None or first.endswith(f" named {name}")), (ask, first)
    assert asked > 200 * 0.5


def test_the_corpus_teaches_chat():
    with open(embedded.CORPUS_PATH) as f:
        texts = [json.loads(line)["text"] for line in f]
    chats = [t for t in texts if t.startswith("<|user|>\n")]
    assert 0.3 < len(chats) / len(texts) < 0.5
    assert all("</s>\n<|assistant|>\nOnce upon a time, " in t for t in chats)
