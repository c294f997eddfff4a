"""Write the embedded corpus and train its tokenizer (deterministic, offline)."""

import json
import re

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from easylm.data import embedded
from easylm.data.embedded.stories import documents


def write_corpus(path, num_documents=embedded.NUM_DOCUMENTS, seed=embedded.SEED):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for text in documents(num_documents, seed):
            f.write(json.dumps({"text": text}) + "\n")


def train_tokenizer(corpus_path, path, vocab_size=embedded.VOCAB_SIZE):
    """A byte-level BPE: every string is encodable, no unknown token is needed."""
    with open(corpus_path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    # The trainer counts special tokens' text as ordinary text: cut it out, or merges
    # like '<|' and '|>' take entries of the vocabulary that no encoding ever uses.
    special = re.compile("|".join(map(re.escape, embedded.SPECIAL_TOKENS)))
    texts = [piece for text in texts for piece in special.split(text) if piece]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=embedded.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    # Like LLaMA's tokenizers, `encode` starts a sequence with BOS.
    bos = embedded.SPECIAL_TOKENS[1]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tokenizer.token_to_id(bos))],
    )
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(tokenizer.to_str(pretty=True) + "\n")


def generate(corpus_path=embedded.CORPUS_PATH, tokenizer_path=embedded.TOKENIZER_PATH):
    write_corpus(corpus_path)
    train_tokenizer(corpus_path, tokenizer_path)
