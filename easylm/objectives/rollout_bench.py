"""GRPO rollout throughput: completion tokens/s of one rollout's generation, several ways.

    python -m easylm.bench rollout --llama.base_model=qwen3_0.6b --dtype=bf16 \
        --prompts=8 --group=8 --prompt_length=512 --new_tokens=256

A rollout is what a GRPO step generates (easylm.objectives.rollouts.generate, the same
function): `prompts` distinct random prompts, each repeated `group` times as GRPO's
groups are, one prefill of every row and then decode calls of `new_tokens` sampled
tokens each (temperature 1, no stop token, so every way does the same work). Measured in
one process, one engine after the other:

    dense   --page_size=0 --share_prompts=False: each row owns seq_length cache
            positions and every copy of a prompt is prefilled
    paged   --page_size=Z --share_prompts=True: the cache in pages, each distinct prompt
            prefilled once and copied to its group's rows; the pool as GRPO sizes it
            (`pages.group_pages`)
    shared  --page_size=0 --share_prompts=True: the dense cache, each distinct prompt
            prefilled once (what sharing gains without pages)
    pages   as paged, with --decode_from_pages: decode attends straight from the pages
            (ragged paged attention), no window gathered or written back
    grouped as pages, with --prefix_groups=prompts and our decode kernel (--decode_kernel,
            batched when rpa): each group's prompt pages read once a step for its rows

Each engine compiles its programs first (`Engine.warmup`, sampling), runs one untimed
rollout, then `repeats` timed ones; the line per way says tokens/s (median), the prompt
tokens it prefilled and the engine's start to the end of its first rollout. Progress
lines are flushed as they happen (a rollout that dies says how far it got).
"""

import faulthandler
import json
import statistics
import sys
import time

import jax
import numpy as np
from ml_collections import ConfigDict

from easylm import flags as flag_lib, model_flags, variants
from easylm.errors import UserError, exit_on_user_error
from easylm.objectives.rollouts import generate, sampling_keys
from easylm.runtime import run_flags
from easylm.runtime.compilation import counting_compiles
from easylm.runtime.sharding import init_sharded, make_mesh
from easylm.serving import engine as engine_lib
from easylm.serving.pages import group_pages
from easylm.serving.cli import ENGINE_MESH_DIM, ENGINE_NOTES, model_config

HELP = {
    "prompts": "distinct prompts of the rollout",
    "group": "completions per prompt (GRPO's num_generations)",
    "prompt_length": "tokens per prompt",
    "new_tokens": "sampled tokens per completion",
    "page_size": "the paged way's --page_size",
    "decode_steps": "tokens decoded per device call (every way)",
    "repeats": "timed rollouts per way (after one untimed)",
    "ways": "comma-separated ways to measure: dense, paged, shared, pages, grouped (the first "
            "is the baseline)",
    "decode_kernel": "the `pages` and `grouped` ways' --decode_kernel: batched or "
                     "batched_vpu (easylm/models/paged_decode_kernel.py), rpa (JAX's ragged "
                     "paged attention; `grouped` takes batched instead)",
    "stall_report_s": "every this many seconds, print every thread's Python stack to stderr "
                      "(faulthandler): where a run that seems stuck is; 0: off",
    **run_flags.help_entries("dtype", "mesh_dim", **ENGINE_NOTES),
}

WAYS = {"dense": {"page_size": 0, "share_prompts": False},
        "paged": {"share_prompts": True},
        "shared": {"page_size": 0, "share_prompts": True},
        "pages": {"share_prompts": True, "decode_from_pages": True},
        "grouped": {"share_prompts": True, "decode_from_pages": True, "prefix_groups": True}}


def default_config(family) -> ConfigDict:
    config = ConfigDict()
    config.prompts = 8
    config.group = 8
    config.prompt_length = 512
    config.new_tokens = 256
    config.page_size = 16
    config.decode_steps = 8
    config.repeats = 2
    config.ways = "dense,paged"
    config.decode_kernel = "batched"
    config.stall_report_s = 0
    config.update(run_flags.get_default_config("dtype", "mesh_dim", mesh_dim=ENGINE_MESH_DIM))
    config[family.name] = model_flags.flag_config(family, family.tiny_preset)
    return config


def measure(way: str, config: ConfigDict, model, params, mesh, prompts) -> dict:
    """One way's row: tokens/s (median of the timed rollouts), prompt tokens prefilled,
    seconds from the engine's start to the end of its first rollout."""
    rows = len(prompts)
    began = time.perf_counter()
    settings = {"batch_size": rows, "seq_length": config.prompt_length + config.new_tokens,
                "min_bucket": config.prompt_length, "decode_steps": config.decode_steps,
                "page_size": config.page_size, **WAYS[way]}
    if settings.get("decode_from_pages"):
        settings["decode_kernel"] = config.decode_kernel
    if settings.get("prefix_groups"):  # one group a prompt; its kernel ours, not rpa
        settings["prefix_groups"] = config.prompts
        settings["decode_kernel"] = "batched" if config.decode_kernel == "rpa" \
            else config.decode_kernel
    if settings["page_size"] and settings["share_prompts"]:  # the pool GRPO's rollouts size
        written = -(-(config.new_tokens - 1) // config.decode_steps) * config.decode_steps
        settings["pages"] = group_pages(rows, config.group, config.prompt_length, written,
                                        settings["seq_length"], settings["page_size"])
    print(f"{way}: making the engine", flush=True)
    engine = engine_lib.Engine(settings, model, params, mesh)
    print(f"{way}: compiling ({time.perf_counter() - began:.1f}s)", flush=True)
    print(f"{way}: {engine.warmup(sample=(True,), score=False)}", flush=True)
    sampling = engine_lib.Sampling.empty(rows)
    sampling.keys[:] = sampling_keys(0, 0, 0, 0, rows)
    sampling.temperature[:] = 1.0
    times, first, timed_compiles = [], None, 0
    for i in range(1 + config.repeats):
        engine.reset()
        with counting_compiles() as compiles:
            start = time.perf_counter()
            out, _ = generate(engine, prompts, sampling, config.new_tokens, eos_id=None)
            elapsed = time.perf_counter() - start
        timed_compiles += len(compiles) if i else 0
        if sum(map(len, out)) != rows * config.new_tokens:
            raise RuntimeError(f"{way}: the rollout generated {sum(map(len, out))} tokens")
        if i == 0:
            first = time.perf_counter() - began
        else:
            times.append(elapsed)
        print(f"{way}: rollout {i} {elapsed:.2f}s, {len(compiles)} compiles", flush=True)
    return {"way": way, "tokens_per_s": rows * config.new_tokens / statistics.median(times),
            "prefilled": engine.prompt_tokens["prefilled"], "start_to_first_rollout_s": first,
            "timed_compiles": timed_compiles}


def run(config: ConfigDict, family) -> list[dict]:
    ways = config.ways.split(",")
    if not ways or set(ways) - set(WAYS):
        raise UserError(f"--ways={config.ways!r}: expected a comma-separated list of "
                        f"{', '.join(WAYS)}")
    for name in ("prompts", "group", "prompt_length", "new_tokens", "page_size", "repeats"):
        if config[name] < 1:
            raise UserError(f"--{name} must be >= 1, got {config[name]}")
    model = variants.build(family, config, model_config(family, config), serving=True)
    if config.prompt_length + config.new_tokens > model.max_seq_length:
        raise UserError(f"--prompt_length + --new_tokens = "
                        f"{config.prompt_length + config.new_tokens} is above the model's "
                        f"max_position_embeddings={model.max_seq_length}")
    mesh = make_mesh(config.mesh_dim)
    print("initialising the weights", flush=True)
    params = init_sharded(model.init_params, model.partition_rules, mesh, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    distinct = [rng.integers(3, model.vocab_size, config.prompt_length).tolist()
                for _ in range(config.prompts)]
    prompts = [p for p in distinct for _ in range(config.group)]
    rows = []
    for way in ways:
        rows.append(measure(way, config, model, params, mesh, prompts))
        print(format_row(rows[-1]), flush=True)
    return rows


def format_row(row: dict) -> str:
    return (f"{row['way']:>5}: {row['tokens_per_s']:>8,.0f} tokens/s, "
            f"{row['prefilled']:,} prompt tokens prefilled, engine start to the end of its "
            f"first rollout {row['start_to_first_rollout_s']:.1f}s")


@exit_on_user_error
def main(argv=None):
    from easylm.models import registry

    family, argv = registry.from_argv(argv or sys.argv, detect=True)
    usage = "usage: python -m easylm.bench rollout [--family=NAME] [--flag=value ...]"
    config = flag_lib.parse(default_config(family), {**HELP, **model_flags.help_entries(family)},
                            argv, usage)
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
    print(f"rollout benchmark on {device}: {config[family.name].base_model}, "
          f"{config.prompts} prompts x {config.group} completions of {config.new_tokens} "
          f"tokens after {config.prompt_length}, dtype {config.dtype}", flush=True)
    if config.stall_report_s > 0:
        faulthandler.dump_traceback_later(config.stall_report_s, repeat=True)
    rows = run(config, family)
    faulthandler.cancel_dump_traceback_later()
    for row in rows[1:]:
        print(f"{row['way']} / {rows[0]['way']}: "
              f"{row['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x", flush=True)
    print(json.dumps({"benchmark": "rollout", "device": device,
                      "flags": flag_lib.flatten(config), "results": rows}))


if __name__ == "__main__":
    main()
