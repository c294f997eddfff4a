"""XLA's memory analysis of the whole distill train step (forward, backward, AdamW update)
against GRPO's of the same shape, compiled from abstract shapes and never run.

    JAX_PLATFORMS=cpu python scripts/distill_memory.py --vocab_size=151936 \
        --rows=8 --tokens=4096 --chunk=512

The student is the debug LLaMA (its widths and layers) with `--vocab_size` rows in the
embedding and head (Qwen3's 151,936 makes the logits dominate, as in a real model); the
teacher has the student's shape (a HF directory of it, written to a temporary directory;
its parameters are an argument of the step, as TrainState.frozen holds them). GRPO: one
prompt's `--rows` completions; distill: `--rows` prompts of one completion each; both
rows of `--tokens` places. Prints one JSON line: each step's peak (arguments + outputs -
aliased + temporaries) and temporaries, and their ratios.
"""

import argparse
import json
import tempfile

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from easylm import objectives, variants
from easylm.llama import train as llama_train
from easylm.llama.family import FAMILY
from easylm.models.family import abstract_params, hf_adapter
from easylm.models.hf_checkpoint import write_safetensors
from easylm.runtime.sharding import BATCH_AXES, make_mesh
from easylm.training import optimizers
from easylm.training.state import abstract_state
from easylm.training.step import jit_train_step

GIB = 2**30


def write_teacher(directory: str, vocab_size: int, tokens: int) -> str:
    config = FAMILY.from_preset("debug", vocab_size=vocab_size, max_position_embeddings=tokens)
    params = FAMILY.module_class(config).init_params(jax.random.key(1))
    write_safetensors(((n, np.asarray(x, np.float32))
                       for n, x in hf_adapter(FAMILY).write_params(params, config)), directory)
    config.to_hf_config().save_pretrained(directory)
    return f"hf::{directory}"


def compiled_memory(objective_flags: list, vocab_size: int, rows: int, tokens: int,
                    chunk: int) -> dict:
    config = llama_train.parse_flags([
        "train", *objective_flags, "--llama.base_model=debug", f"--llama.vocab_size={vocab_size}",
        f"--llama.max_position_embeddings={tokens}", f"--llama.loss_chunk_size={chunk}",
        f"--train_dataset.json_dataset.seq_length={tokens}",
        "--train_dataset.json_dataset.batch_size=1", "--dtype=fp32", "--mesh_dim=1,1,1"])
    model = variants.build(FAMILY, config)
    objective = objectives.build(config, model, None)
    tx, schedule = optimizers.get_optimizer(config.optimizer)
    mesh = make_mesh("1,1,1", jax.devices()[:1])
    sharded = NamedSharding(mesh, P(BATCH_AXES))
    shape = lambda *s, dtype="int32": jax.ShapeDtypeStruct(s, dtype, sharding=sharded)  # noqa: E731
    grpo = config.objective == "grpo"
    lead = (1, rows) if grpo else (rows,)
    batch = {"input_tokens": shape(*lead, tokens), "target_tokens": shape(*lead, tokens),
             "loss_masks": shape(*lead, tokens, dtype="float32")}
    if grpo:
        batch.update(advantages=shape(*lead, dtype="float32"),
                     valid=shape(*lead, dtype="float32"))
    with jax.set_mesh(mesh):
        state = abstract_state(model, tx, mesh, 0)
        if not grpo:
            state = state.replace(frozen={"teacher": abstract_params(objective.teacher.model,
                                                                     mesh)})
        step = jit_train_step(model, tx, schedule, 0, 1, state, mesh, objective.loss_fn)
        memory = step.lower(state, batch).compile().memory_analysis()
    peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
            - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    return {"peak_gib": round(peak / GIB, 3), "temp_gib": round(memory.temp_size_in_bytes / GIB, 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab_size", type=int, default=151936)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    V, N, T, C = args.vocab_size, args.rows, args.tokens, args.chunk
    grpo = compiled_memory(["--objective=grpo", f"--grpo.num_generations={N}"], V, N, T, C)
    with tempfile.TemporaryDirectory() as directory:
        teacher = write_teacher(directory, V, T)
        distill = compiled_memory(["--objective=distill", f"--distill.teacher={teacher}"],
                                  V, N, T, C)
    print(json.dumps({
        "vocab_size": V, "rows": N, "tokens": T, "chunk": C, "grpo": grpo, "distill": distill,
        "peak_ratio": round(distill["peak_gib"] / grpo["peak_gib"], 3),
        "temp_ratio": round(distill["temp_gib"] / grpo["temp_gib"], 3),
    }))


if __name__ == "__main__":
    main()
