"""Per-device memory of a LoRA/QLoRA train step, from XLA's own `memory_analysis()`.

The step is compiled for abstract state (ShapeDtypeStructs with shardings): nothing is
allocated, so a 70B model plans on a laptop CPU. It is the LoRA step as the trainer will
run it: the loss of base + adapters (chunked cross-entropy), gradients for the adapters
only, AdamW on them, adapters and optimizer state donated; the frozen base is an input.

    python scripts/lora_memory.py --model=llama3_8b --base_dtype=bf16 --seq_length=4096
    python scripts/lora_memory.py --model=llama2_70b --base_dtype=nf4 --seq_length=2048

Prints one JSON line. `python -m easylm.bench train --compile_only=True` will measure the
same once the trainer runs LoRA (issue 20, phase B).
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from easylm.llama.config import LLaMAConfig
from easylm.llama.lora import lora_model
from easylm.llama.model import PARTITION_RULES, lm_head_weight
from easylm.lora import LoraConfig, partition_rules
from easylm.losses import chunked_next_token_loss
from easylm.sharding import BATCH_AXES, make_mesh, match_partition_rules, named_shardings

GIB = 2 ** 30


def abstract(tree, mesh, rules):
    specs = match_partition_rules(rules, tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, named_shardings(mesh, specs))


def measure(args) -> dict:
    config = LLaMAConfig.from_preset(args.model, scan_layers=True, remat_policy=args.remat,
                                     loss_chunk_size=args.loss_chunk_size)
    dtype = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[args.dtype]
    lora = LoraConfig(rank=args.rank, base_dtype=args.base_dtype)
    lm = lora_model(config, lora, dtype=dtype)
    mesh = make_mesh(args.mesh_dim)
    rules = partition_rules(PARTITION_RULES)
    tx = optax.adamw(1e-4, weight_decay=0.01)
    with jax.set_mesh(mesh):
        base = abstract(jax.eval_shape(lambda: lm.store_base(
            lm.base_module.init_params(jax.random.key(0)))), mesh, rules)
        adapters = abstract(lm.adapter_shapes, mesh, rules)
        opt_state = abstract(jax.eval_shape(tx.init, lm.adapter_shapes), mesh, rules)
        batch_sharding = NamedSharding(mesh, P(BATCH_AXES, None))
        ids = jax.ShapeDtypeStruct((args.batch_size, args.seq_length), jnp.int32,
                                   sharding=batch_sharding)
        masks = jax.ShapeDtypeStruct(ids.shape, jnp.float32, sharding=batch_sharding)

        def step(adapters, opt_state, base, inputs, targets, masks):
            def loss(adapters):
                hidden = lm.apply(base, adapters, inputs, return_hidden=True)
                sums = chunked_next_token_loss(hidden, lm_head_weight(base, config), targets,
                                               masks, config.loss_chunk_size)
                return sums.loss / jnp.maximum(sums.tokens, 1.0)

            value, grads = jax.value_and_grad(loss)(adapters)
            updates, opt_state = tx.update(grads, opt_state, adapters)
            return optax.apply_updates(adapters, updates), opt_state, value

        start = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
            adapters, opt_state, base, ids, ids, masks).compile()
        seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    per_device = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                  - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    return {
        "model": args.model, "base_dtype": args.base_dtype, "rank": args.rank,
        "seq_length": args.seq_length, "batch_size": args.batch_size, "remat": args.remat,
        "mesh": dict(mesh.shape), "compile_time_s": round(seconds, 1),
        # uint4 is counted at 1 byte by numpy's itemsize; XLA packs it (the argument sizes).
        "adapter_parameters": lm.num_adapter_parameters(),
        "adapters_gb": round(nbytes(adapters) / GIB, 3),
        "xla_arguments_gb": round(memory.argument_size_in_bytes / GIB, 3),
        "xla_temp_gb": round(memory.temp_size_in_bytes / GIB, 3),
        "xla_memory_gb_per_device": round(per_device / GIB, 3),
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "jax": jax.__version__,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3_8b")
    parser.add_argument("--base_dtype", default="bf16", choices=("bf16", "fp32", "int8", "nf4"))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seq_length", type=int, default=4096)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--remat", default="nothing_saveable")
    parser.add_argument("--loss_chunk_size", type=int, default=1024)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--mesh_dim", default="1,-1,1")
    print(json.dumps(measure(parser.parse_args())))


if __name__ == "__main__":
    main()
