"""`python -m easylm.data.embedded`: regenerate corpus.jsonl and tokenizer.json in place."""

from easylm.data import embedded
from easylm.data.embedded.generate import generate

if __name__ == "__main__":
    generate()
    print(f"wrote {embedded.CORPUS_PATH} and {embedded.TOKENIZER_PATH}")
