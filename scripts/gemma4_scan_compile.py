"""What `--gemma4.scan_layers` costs or saves in compile time on a model with per-layer
inputs and KV sharing: the training step (next-token loss and its gradient) traced,
lowered and compiled by XLA, scanned and unscanned, for the debug preset (6 layers: two
blocks of one repeat) and a tiny model of E2B's shape (35 layers, every 5th full, the
last 20 KV-shared, their MLPs double wide: blocks of 3 and 4 repeats of 5). fp32, CPU,
one row of 64 tokens, the default remat policy; CPU seconds, the fastest of 3 each.

    JAX_PLATFORMS=cpu python scripts/gemma4_scan_compile.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from easylm.gemma4.family import FAMILY
from easylm.models.decoder import scan_blocks
from easylm.objectives.next_token import next_token_sums

E2B_SHAPED = dict(num_hidden_layers=35, num_kv_shared_layers=20, use_double_wide_mlp=True,
                  layer_types=",".join("full_attention" if (i + 1) % 5 == 0 else
                                       "sliding_attention" for i in range(35)))


def compile_seconds(config, tokens: int = 64) -> float:
    """CPU seconds (all threads of this process: less moved by other work on the machine
    than wall time) to trace, lower and compile the training step of `config`."""
    model = FAMILY.bind(config)
    params = jax.eval_shape(model.init_params, jax.random.key(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 500, (1, tokens)))
    batch = dict(input_tokens=ids, target_tokens=jnp.roll(ids, -1, 1),
                 loss_masks=jnp.ones(ids.shape, jnp.float32))
    step = jax.jit(jax.value_and_grad(
        lambda p: next_token_sums(model, p, batch, None).means()["loss"]))
    start = time.process_time()
    step.lower(params).compile()
    return time.process_time() - start


def main(rounds: int = 3):
    compile_seconds(FAMILY.from_preset("debug"))  # warm the process up
    for name, overrides in (("debug", {}), ("E2B-shaped", E2B_SHAPED)):
        config = FAMILY.from_preset("debug", **overrides)
        scanned = config.replace(scan_layers=True)
        blocks = scan_blocks(FAMILY.module_class, scanned)
        times = {"unscanned": [], "scanned": []}
        for _ in range(rounds):  # alternating, the fastest of each
            for label, c in (("unscanned", config), ("scanned", scanned)):
                times[label].append(compile_seconds(c))
        u, s = min(times["unscanned"]), min(times["scanned"])
        print(f"{name} ({config.num_hidden_layers} layers, blocks (first layer, repeats) "
              f"{blocks}): unscanned {u:.2f} s, scanned {s:.2f} s (CPU time, fastest of "
              f"{rounds}); scanned / unscanned {s / u:.2f}")


if __name__ == "__main__":
    main()
