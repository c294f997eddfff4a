"""Held-out loss of one checkpoint served in fp32 and bf16, each with and without
--quantize=int8 (docs/serving.md, Int8 weights).

    PYTHONPATH=. python scripts/int8_accuracy.py runs/RUN/checkpoints/200 [--documents=200]

The documents are the embedded corpus's kind of stories from another seed than the
corpus's, so none was trained on. Prints the mean loss per target token and the share of
targets that are the greedy choice, through the serving engine's scoring.
"""

import argparse

import numpy as np

from easylm import flags as flag_lib
from easylm.data.embedded.stories import documents
from easylm.llama.family import FAMILY
from easylm.serving import cli


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--documents", type=int, default=200)
    args = parser.parse_args()
    texts = list(documents(args.documents, seed=12345))
    for dtype in ("fp32", "bf16"):
        for quantize in ("none", "int8"):
            config = flag_lib.parse(cli.default_config(FAMILY), cli.help_entries(FAMILY), [
                "serve", f"--load_checkpoint=params::{args.checkpoint}", "--tokenizer=embedded",
                "--seq_length=256", "--batch_size=16", f"--dtype={dtype}",
                f"--quantize={quantize}"])
            engine, tokenizer, _ = cli.load_engine(FAMILY, config)
            ids = [tokenizer(t)["input_ids"][:256] for t in texts]
            scored = engine.score([i[:-1] for i in ids], [i[1:] for i in ids])
            loss = -sum(float(np.sum(r[0])) for r in scored) / sum(len(i) - 1 for i in ids)
            greedy = float(np.mean(np.concatenate([r[1] for r in scored])))
            print(f"{dtype} quantize={quantize}: loss {loss:.4f}, greedy {greedy:.4f}", flush=True)


if __name__ == "__main__":
    main()
