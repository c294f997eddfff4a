"""XLA's memory analysis of GRPO's whole train step (forward, backward, AdamW update),
compiled from abstract shapes and never run, with the full (N, T, V) logits and with
`--llama.loss_chunk_size` chunking, beside the saving the chunking predicts.

    JAX_PLATFORMS=cpu python scripts/grpo_memory.py --vocab_size=151936 \
        --completions=8 --tokens=4096 --chunk=512

The model is the debug LLaMA (its widths and layers) with `--vocab_size` rows in the
embedding and head (Qwen3's 151,936 makes the logits dominate, as they do in a real
model; the debug model's own 512 do not). One prompt's `--completions` rows of `--tokens`
places each: N = completions, T = tokens. Full logits keep two (N, T, V) fp32 buffers
(the logits and their gradient, 8 N T V bytes); chunked, two (N, chunk, V): the
prediction is 8 N (T - chunk) V bytes less. Prints one JSON line.
"""

import argparse
import json

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from easylm import objectives, variants
from easylm.llama import train as llama_train
from easylm.llama.family import FAMILY
from easylm.runtime.sharding import BATCH_AXES, make_mesh
from easylm.training import optimizers
from easylm.training.state import abstract_state
from easylm.training.step import jit_train_step

GIB = 2**30


def compiled_memory(vocab_size: int, completions: int, tokens: int, chunk: int) -> dict:
    """XLA's memory analysis (GiB) of the GRPO train step with --llama.loss_chunk_size=chunk
    (0: full logits)."""
    config = llama_train.parse_flags([
        "train", "--objective=grpo", "--llama.base_model=debug", f"--llama.vocab_size={vocab_size}",
        f"--llama.max_position_embeddings={tokens}", f"--llama.loss_chunk_size={chunk}",
        f"--grpo.num_generations={completions}", f"--train_dataset.json_dataset.seq_length={tokens}",
        "--train_dataset.json_dataset.batch_size=1", "--dtype=fp32", "--mesh_dim=1,1,1"])
    model = variants.build(FAMILY, config)
    objective = objectives.build(config, model, None)
    tx, schedule = optimizers.get_optimizer(config.optimizer)
    mesh = make_mesh("1,1,1", jax.devices()[:1])
    rows = NamedSharding(mesh, P(BATCH_AXES))
    shape = lambda *s, dtype="int32": jax.ShapeDtypeStruct(s, dtype, sharding=rows)  # noqa: E731
    batch = {"input_tokens": shape(1, completions, tokens),
             "target_tokens": shape(1, completions, tokens),
             "loss_masks": shape(1, completions, tokens, dtype="float32"),
             "advantages": shape(1, completions, dtype="float32"),
             "valid": shape(1, completions, dtype="float32")}
    with jax.set_mesh(mesh):
        state = abstract_state(model, tx, mesh, 0)
        step = jit_train_step(model, tx, schedule, 0, 1, state, mesh, objective.loss_fn)
        memory = step.lower(state, batch).compile().memory_analysis()
    peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
            - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    return {"peak_gib": round(peak / GIB, 3), "temp_gib": round(memory.temp_size_in_bytes / GIB, 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab_size", type=int, default=151936)
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    N, T, V, C = args.completions, args.tokens, args.vocab_size, args.chunk
    full = compiled_memory(V, N, T, 0)
    chunked = compiled_memory(V, N, T, C)
    predicted = 8 * N * (T - C) * V
    print(json.dumps({
        "vocab_size": V, "completions": N, "tokens": T, "chunk": C,
        "full_logits": full, "chunked": chunked,
        "measured_saving_gib": round(full["peak_gib"] - chunked["peak_gib"], 3),
        "predicted_saving_gib": round(predicted / GIB, 3),
        "peak_ratio": round(full["peak_gib"] / chunked["peak_gib"], 2),
    }))


if __name__ == "__main__":
    main()
