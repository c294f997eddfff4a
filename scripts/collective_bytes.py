"""Bytes each kind of collective produces in one compiled train step, and XLA's warnings.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python scripts/collective_bytes.py --llama.base_model=debug --mesh_dim=2,4,1 --batch_size=16

Takes `python -m easylm.bench train`'s flags and compiles the same step (nothing runs).
Sizes come from the result shapes of the collectives in the compiled HLO text, so they
compare sharding choices on one machine; they are not a network measurement (and where
collectives are asynchronous, a `-start` tuple counts its operand too).
"""

import collections
import math
import re
import sys

import jax

from easylm import bench, flags, model_flags
from easylm.llama.family import FAMILY
from easylm.runtime.sharding import make_mesh
from easylm.training import optimizers
from easylm.training.state import init_state
from easylm.training.step import device_batch, jit_train_step

OPS = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")
# `name = TYPE op(` or `name = (TYPE, TYPE) op-start(`: the result type(s) of one collective.
INSTRUCTION = re.compile(r"= (\(?[^=]*?\)?) (" + "|".join(OPS) + r")(-start)?\(")
ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")

# HLO element types -> bytes.
BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
         "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def collective_bytes(hlo_text: str) -> dict:
    totals = collections.Counter()
    for result, op, _ in INSTRUCTION.findall(hlo_text):
        for dtype, shape in ARRAY.findall(result):
            totals[op] += math.prod(int(d) for d in shape.split(",") if d) * BYTES[dtype]
    return dict(totals)


def main(argv):
    config = flags.parse(bench.train_config(FAMILY), bench._train_help(FAMILY), argv)
    mesh = make_mesh(config.mesh_dim)
    model = model_flags.build(FAMILY, config)
    tx, schedule = optimizers.get_optimizer(config.optimizer)
    with jax.set_mesh(mesh):
        state = init_state(model, tx, mesh, config.seed)
        step = jit_train_step(model, tx, schedule, config.seed,
                                      config.optimizer.accumulate_gradient_steps, state, mesh)
        batch = device_batch(bench.synthetic_batch(config, model.vocab_size), mesh)
        text = step.lower(state, batch).compile().as_text()
    print({op: f"{n / 1e6:.3f} MB" for op, n in collective_bytes(text).items()})


if __name__ == "__main__":
    main(sys.argv)
