"""Decode throughput: generated tokens/s of the serving engine at several batch sizes.

    python -m easylm.bench decode --llama.base_model=debug --batch_sizes=1,16,64 \
        --prompt_length=128 --new_tokens=256

Each batch size gets its own engine with exactly that many slots; every slot is
given a random prompt and generates new_tokens greedily (no stop tokens), through
the same batcher the server uses (detokenization included). A first run is not timed. With --hf (default on CPU), Hugging Face transformers'
`generate` with a static cache runs the same weights on the same prompts in the
same process, and the table shows the ratio. Each engine prints what its warm-up
compiled and how long it took, and the row the time from the engine's start (its
compiles included) to its first token.
"""

import importlib.util
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from easylm import flags as flag_lib, model_flags
from easylm.errors import UserError, exit_on_user_error
from easylm.models.family import torch_reference
from easylm.runtime import run_flags
from easylm.runtime.compilation import counting_compiles
from easylm.runtime.dtypes import dtype_from_flag
from easylm.runtime.sharding import init_sharded, make_mesh
from easylm.serving import engine as engine_lib
from easylm.serving.batcher import Batcher, SamplingParams
from easylm.serving.cli import ENGINE_MESH_DIM, ENGINE_NOTES, model_config
from easylm import variants
from easylm.variants import quantize

HELP = {
    "batch_sizes": "comma-separated batch sizes (decode slots) to measure",
    "prompt_length": "prompt tokens per request",
    "new_tokens": "tokens generated per request",
    "seq_length": "the engine's context (the server's --seq_length): cache positions per "
                  "slot; 0: prompt_length + new_tokens",
    "decode_steps": "tokens decoded per device call",
    "decode_unroll": "the engine's --decode_unroll: the steps of a call unrolled, not a loop",
    "page_size": "the engine's --page_size: the cache in pages of this many positions; 0: "
                 "a dense cache",
    "decode_from_pages": "the engine's --decode_from_pages (with --page_size)",
    "decode_kernel": "the engine's --decode_kernel (with --decode_from_pages): batched, rpa, "
                     "batched_vpu",
    **run_flags.help_entries("dtype", "mesh_dim", **ENGINE_NOTES),
    "quantize": "comma-separated weight formats to time side by side: none (the dtype's), "
                "int8 (--quantize=int8 of the server)",
    "hf": "also time HF transformers generate (static cache): auto (on CPU, when torch is "
          "installed), true, false",
}


def default_config(family) -> ConfigDict:
    config = ConfigDict()
    config.batch_sizes = "1,16,64"
    config.prompt_length = 128
    config.new_tokens = 256
    config.seq_length = 0
    config.decode_steps = 8
    config.decode_unroll = False
    config.page_size = 0
    config.decode_from_pages = False
    config.decode_kernel = "batched"
    config.update(run_flags.get_default_config("dtype", "mesh_dim", mesh_dim=ENGINE_MESH_DIM))
    config.quantize = "none"
    config.hf = "auto"
    config[family.name] = model_flags.flag_config(family, family.tiny_preset)
    return config


def help_entries(family) -> dict:
    return {**HELP, **model_flags.help_entries(family)}


def engine_tokens_per_second(model, params, batch: int, config, tokenizer, prompts,
                             mesh) -> tuple[float, float, int]:
    """(tokens/s, seconds from the engine's start to a first token, XLA compiles inside
    the timed run): the engine is made
    and warmed up (its greedy programs compiled: `Engine.warmup`) and serves one token,
    then the timed run (after one untimed one)."""
    began = time.perf_counter()
    engine = engine_lib.Engine(
        {"batch_size": batch, "seq_length": config.seq_length or config.prompt_length + config.new_tokens,
         "decode_steps": config.decode_steps, "decode_unroll": config.decode_unroll,
         "min_bucket": config.prompt_length, "page_size": config.page_size,
         "decode_from_pages": config.decode_from_pages, "decode_kernel": config.decode_kernel,
         # The runs repeat their prompts: with pages, sharing would find them cached and
         # run the timed prompts as extends, whose programs warm-up does not compile.
         "share_prompts": False},
        model, params, mesh)
    print(f"batch {batch:>4}: {engine.warmup(sample=(False,), score=False)}", flush=True)
    batcher = Batcher(engine).start()
    greedy = SamplingParams(max_tokens=config.new_tokens, temperature=0.0)
    try:
        batcher.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0.0), tokenizer)
        first = time.perf_counter() - began
        batcher.generate(prompts, greedy, tokenizer)
        with counting_compiles() as compiles:
            start = time.perf_counter()
            gens = batcher.generate(prompts, greedy, tokenizer)
            elapsed = time.perf_counter() - start
    finally:
        batcher.stop()
    assert all(len(g.tokens) == config.new_tokens for g in gens)
    if compiles:  # a timed run that compiled measures the compiler, not the engine
        seconds = sum(c.seconds for c in compiles)
        print(f"batch {batch:>4}: {len(compiles)} compiles ({seconds:.1f}s) inside the timed "
              f"run", flush=True)
    return batch * config.new_tokens / elapsed, first, len(compiles)


def hf_tokens_per_second(hf_model, prompts, new_tokens: int) -> float:
    import torch

    ids = torch.tensor(prompts, device=hf_model.device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        hf_model.generate(ids, **kwargs)  # warm-up, as for the engine
        if ids.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = hf_model.generate(ids, **kwargs)
        if ids.is_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / elapsed


def run(config: ConfigDict, family) -> list[dict]:
    from easylm.data.tokenizer import load_tokenizer

    settings = model_config(family, config)
    batch_sizes, formats, dtype, use_hf = _read_flags(config)
    # Each weight format's model as the server builds it (--quantize=int8: the int8
    # variant), all drawing the same random weights from the same key, quantized or not.
    built = {name: variants.build(family, _with(config, quantize=name), settings,
                                  serving=True) for name in ("none", *formats)}
    model = built["none"]
    _check_lengths(config, model.max_seq_length)
    mesh = make_mesh(config.mesh_dim)
    if mesh.shape["sp"] > 1:  # decoding reads a whole cache; only training splits rows
        raise UserError(f"--mesh_dim={config.mesh_dim}: serving does not split the sequence; "
                        f"give sp=1 (split the devices over fsdp or mp instead)")
    weights = {name: (built[name], init_sharded(built[name].init_params,
                                                built[name].partition_rules, mesh,
                                                jax.random.PRNGKey(0)))
               for name in formats}  # weight format -> (model, parameters)
    hf_model = None
    if use_hf:  # the float weights
        params = weights["none"][1] if "none" in formats else init_sharded(
            model.init_params, model.partition_rules, mesh, jax.random.PRNGKey(0))
        hf_model = _hf_model(config, family, settings, params, dtype)
    tokenizer = load_tokenizer("embedded")
    rows = []
    for batch in batch_sizes:
        row = _measure(batch, config, model.vocab_size, weights, hf_model, tokenizer, mesh)
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def _with(config: ConfigDict, **changes) -> ConfigDict:
    out = ConfigDict(config.to_dict())
    out.update(changes)
    return out


def _read_flags(config: ConfigDict):
    """(batch sizes, weight formats, compute dtype, whether HF runs too), each flag checked."""
    try:
        batch_sizes = [int(b) for b in config.batch_sizes.split(",")]
    except ValueError:
        raise UserError(f"--batch_sizes={config.batch_sizes!r} must be comma-separated integers")
    formats = config.quantize.split(",")
    if not formats or set(formats) - set(quantize.MODES):
        raise UserError(f"--quantize={config.quantize!r}: expected a comma-separated list of "
                        f"{', '.join(quantize.MODES)}")
    dtype = dtype_from_flag("dtype", config.dtype)
    on_cpu_with_torch = jax.default_backend() == "cpu" and importlib.util.find_spec("torch")
    use_hf = {"auto": bool(on_cpu_with_torch), "true": True, "false": False}.get(config.hf)
    if use_hf is None:
        raise UserError(f"--hf={config.hf!r} is not one of auto, true, false")
    return batch_sizes, formats, dtype, use_hf


def _check_lengths(config: ConfigDict, limit: int):
    """The prompt, the new tokens and the engine's context against the model's `limit`."""
    if config.prompt_length + config.new_tokens > limit:
        raise UserError(f"--prompt_length + --new_tokens = "
                        f"{config.prompt_length + config.new_tokens} is above the model's "
                        f"max_position_embeddings={limit}")
    if config.seq_length and not (config.prompt_length + config.new_tokens <= config.seq_length
                                  <= limit):
        raise UserError(f"--seq_length={config.seq_length} must be between prompt_length + "
                        f"new_tokens = {config.prompt_length + config.new_tokens} and the "
                        f"model's max_position_embeddings={limit}")


def _hf_model(config: ConfigDict, family, settings, params, dtype):
    """HF transformers' model holding `params`, on the GPU when there is one, with no
    end-of-sequence token (every request generates all its tokens, as on the engine)."""
    hf_model = torch_reference(family, settings, params)
    import torch

    hf_model.generation_config.eos_token_id = None
    # On a GPU host, HF runs on the GPU too, in the same dtype.
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        jnp.dtype(dtype).name, torch.float32)
    hf_model.to("cuda" if torch.cuda.is_available() else "cpu", dtype=torch_dtype)
    return hf_model


def _measure(batch: int, config: ConfigDict, vocab_size: int, variants: dict, hf_model,
             tokenizer, mesh) -> dict:
    """One row of the table: each weight format's tokens/s at `batch` slots, and HF's."""
    prompts = np.random.RandomState(batch).randint(
        3, vocab_size, (batch, config.prompt_length)).tolist()
    row = {"batch": batch}
    for name, (variant, weights) in variants.items():
        prefix = KEYS[name][:-len('tokens_per_s')]
        row[KEYS[name]], row[f"{prefix}first_token_s"], row[f"{prefix}timed_compiles"] = \
            engine_tokens_per_second(variant, weights, batch, config, tokenizer, prompts, mesh)
    if hf_model is not None:
        row["hf_tokens_per_s"] = hf_tokens_per_second(hf_model, prompts, config.new_tokens)
        for name in variants:
            row[f"{RATIOS[name]}"] = row[KEYS[name]] / row["hf_tokens_per_s"]
    return row


KEYS = {"none": "easylm_tokens_per_s", "int8": "easylm_int8_tokens_per_s"}
RATIOS = {"none": "ratio", "int8": "int8_ratio"}


def format_row(row: dict) -> str:
    text = f"batch {row['batch']:>4}:"
    for name, key in KEYS.items():
        if key in row:
            label = "easylm" if name == "none" else f"easylm {name}"
            text += f" {label} {row[key]:>10,.0f} tokens/s"
            first = row.get(f"{key[:-len('tokens_per_s')]}first_token_s")
            if first is not None:
                text += f" (engine start to first token {first:.1f}s)"
    if "hf_tokens_per_s" in row:
        text += f"   HF static cache {row['hf_tokens_per_s']:>10,.0f} tokens/s"
        text += "".join(f"   ratio{'' if n == 'none' else ' ' + n} {row[RATIOS[n]]:.2f}x"
                        for n in KEYS if RATIOS[n] in row)
    return text


@exit_on_user_error
def main(argv=None):
    from easylm.models import registry

    family, argv = registry.from_argv(argv or sys.argv, detect=True)
    usage = "usage: python -m easylm.bench decode [--family=NAME] [--flag=value ...]"
    config = flag_lib.parse(default_config(family), help_entries(family), argv, usage)
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
    print(f"decode benchmark on {device}: {config[family.name].base_model}, prompt "
          f"{config.prompt_length}, {config.new_tokens} new tokens, context "
          f"{config.seq_length or config.prompt_length + config.new_tokens}, dtype {config.dtype}")
    rows = run(config, family)
    # One JSON line too, like `python -m easylm.bench train`, for scripts.
    print(json.dumps({"benchmark": "decode", "device": device, "flags": flag_lib.flatten(config),
                      "results": rows}))


if __name__ == "__main__":
    main()
