import json
import os
import subprocess
import sys

import jax
import pytest

from easylm import variants
from easylm.objectives.next_token import next_token_sums


def run_bench(*flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "easylm.bench", *flags], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.slow
def test_train_bench_prints_one_json_line_and_fills_the_compilation_cache(tmp_path):
    cache = tmp_path / "cache"
    result = run_bench("train", "--seq_length=32", "--batch_size=8", "--steps=2", "--mesh_dim=2,2,2",
                       "--llama.loss_chunk_size=16", f"--compilation_cache_dir={cache}")
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["benchmark"] == "train" and row["mesh"] == {"dp": 2, "fsdp": 2, "mp": 2}
    assert row["tokens_per_second"] > 0 and row["step_time_s"] > 0 and row["compile_time_s"] > 0
    assert row["mfu"] is None  # CPUs have no peak in the table
    assert 5.0 < row["final_loss"] < 7.0  # ~ln(512) for random tokens
    assert len(row["losses"]) == 2 + 2 and row["losses"][-1] == row["final_loss"]
    assert row["losses"][-1] < row["losses"][0]  # the same batch each step: it learns
    assert any(cache.iterdir())  # the compiled step was stored for the next start
    # With dp > 1 no activation or gradient is replicated to change its sharding.
    assert "Involuntary full rematerialization" not in result.stderr


@pytest.mark.slow
def test_compile_only_allocates_nothing_and_reports_xla_memory():
    # llama_7b would need ~40 GB to run; compiling it for 8 devices needs none of that.
    result = run_bench("train", "--compile_only=True", "--llama.base_model=llama_7b",
                       "--llama.scan_layers=True", "--llama.remat_policy=nothing_saveable",
                       "--dtype=bf16", "--param_dtype=bf16", "--optimizer.state_dtype=bf16",
                       "--seq_length=256", "--batch_size=8", "--mesh_dim=1,-1,1")
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["compile_only"] and row["parameters"] == 6_738_415_616
    # Each device's eighth of the donated state, bf16 parameters and two bf16 moments (6
    # bytes a parameter), plus gradients and temporaries.
    assert 6 * row["parameters"] / 8 / 2**30 < row["xla_memory_gb_per_device"] < 20
    assert row["compile_time_s"] > 0


@pytest.mark.slow
def test_bench_bad_input():
    result = run_bench("train", "--steps=0")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --steps and --warmup_steps must be >= 1 (the first warm-up step compiles)"
    result = run_bench("speed")
    assert result.returncode == 2 and result.stderr.startswith("error: expected a benchmark name")


def bench_row(capsys, *flags) -> dict:
    """`python -m easylm.bench train FLAGS`, in-process (8 CPU devices)."""
    from easylm import bench

    bench.main(["bench", "train", *flags])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_compile_only_lora_trains_adapters_on_a_frozen_base_in_less_memory(capsys):
    # The trainer's own step for the LoRA variant and for full fine-tuning of the same
    # model (fsdp over 8 devices), a shape whose parameters dominate.
    def compile_only(*flags):
        return bench_row(capsys, "--compile_only=True", "--seq_length=16", "--batch_size=8",
                         "--llama.hidden_size=256", "--llama.intermediate_size=1024", *flags)

    # A bf16 base (the default follows --dtype, fp32 on this CPU).
    lora, full = compile_only("--lora.rank=4", "--lora.base_dtype=bf16"), compile_only()
    # debug: 2 layers, 4 heads of 64, 2 key/value heads; rank 4 on the 7 projections:
    # r * (in + out) each.
    D, KV, I = 256, 2 * 64, 1024
    assert lora["parameters"] == 2 * 4 * (2 * (D + D) + 2 * (D + KV) + 3 * (D + I))
    assert lora["variant"] == "LoRA rank 4" and lora["frozen_dtype"] == "bf16"
    assert lora["frozen_parameters"] == full["parameters"] and "frozen_parameters" not in full
    assert lora["frozen_gb"] == round(2 * full["parameters"] / 2**30, 3)
    # Per device, full fine-tuning also holds each base weight's fp32 gradient and two
    # Adam moments (12 bytes, split 8 ways) that LoRA has for its adapters alone.
    gb = 12 * full["parameters"] / 8 / 2**30
    assert lora["xla_memory_gb_per_device"] < full["xla_memory_gb_per_device"] - gb, (lora, full)


def test_lora_flops_per_token_skip_the_base_weight_gradients():
    # MFU's numerator: against XLA's own count of the compiled loss-and-gradient (forward
    # and backward, no remat), LoRA's over full fine-tuning's. XLA also counts the
    # elementwise work (norms, softmax) the 6N-style formulas leave out: a few percent here.
    from easylm import bench, flags
    from easylm.llama.family import FAMILY

    T, ratios = 64, []
    for extra in (["--lora.rank=4"], []):
        config = flags.parse(bench.train_config(FAMILY), {}, [
            "bench", f"--seq_length={T}", "--llama.hidden_size=256",
            "--llama.intermediate_size=1024", "--llama.remat_policy=none", *extra])
        model = variants.build(FAMILY, config)
        key = jax.random.key(0)
        params = jax.eval_shape(model.init_params, key)
        frozen = None if model.frozen is None else jax.eval_shape(model.frozen.init, key)
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
                 for k, v in bench.synthetic_batch(config, model.vocab_size).items()}
        grad = jax.jit(jax.grad(lambda p, b, base: next_token_sums(model, p, b, key, base).loss))
        flops = grad.lower(params, batch, frozen).compile().cost_analysis()["flops"]
        ratios.append((model.flops_per_token(T), flops / (config.batch_size * T)))
    (lora, lora_xla), (full, full_xla) = ratios
    assert lora / full == pytest.approx(lora_xla / full_xla, rel=0.05)
    assert lora_xla / full_xla < 0.8  # the base's own formula (ratio 1) would fail


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_qlora_step_runs_and_learns(optimizer, capsys):
    # The timed steps on an nf4 base (a uint4 argument of the step), the adapters trained
    # (by Muon: each adapter matrix A and B orthogonalized on its own).
    row = bench_row(capsys, "--lora.rank=4", "--lora.base_dtype=nf4", "--seq_length=16",
                    "--batch_size=8", "--warmup_steps=1", "--steps=2",
                    "--optimizer.adamw_optimizer.lr=1e-2",
                    "--optimizer.adamw_optimizer.lr_warmup_steps=0",
                    f"--optimizer.type={optimizer}")
    assert row["optimizer"] == optimizer
    assert row["variant"] == "QLoRA rank 4" and row["frozen_dtype"] == "nf4"
    assert row["parameters"] == 2 * 4 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128))
    assert len(row["losses"]) == 3 and row["losses"][-1] < row["losses"][0]  # the same batch
    assert row["tokens_per_second"] > 0


def test_a_long_sequence_step_compiles_under_sp_and_rows_must_split(capsys):
    """`--mesh_dim=dp=1,fsdp=2,sp=4 --context_parallel=ring`: the trainer's step with rows
    split over sp (zig-zag), compiled for abstract shapes; a row that does not split over
    2*sp places is one line (measurements of the step: docs/long_context.md)."""
    from easylm import bench

    row = bench_row(capsys, "--compile_only=True", "--seq_length=16", "--batch_size=2",
                    "--mesh_dim=dp=1,fsdp=2,sp=4", "--context_parallel=ring")
    assert row["mesh"]["sp"] == 4 and row["context_parallel"] == "ring"
    assert row["xla_memory_gb_per_device"] > 0
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["bench", "train", "--seq_length=12", "--mesh_dim=dp=1,fsdp=2,sp=4"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: --seq_length=12 must be a multiple of 2*sp = 8 to split rows over "
        "--mesh_dim=dp=1,fsdp=2,sp=4")
