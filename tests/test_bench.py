import json
import pytest
import os
import subprocess
import sys


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
