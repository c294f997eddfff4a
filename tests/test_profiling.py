"""easylm.runtime.profiling: the trace summary on synthetic GPU and CPU traces, `bench train
--profile_steps`, and the trainer's profile window (also when the run ends inside it)."""

import csv
import glob
import gzip
import json
import os

import jax
import pytest
from test_bench import run_bench

from easylm.llama import train
from easylm.runtime import profiling

GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"
SDPA = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
LONG_NAME = "%fusion.1 = bf16[8,2048,2048]{2,1,0} fusion(" + "bf16[8,2048,2048] %p, " * 20 + ")"


def write_trace(log_dir, processes: dict) -> str:
    """A perfetto_trace.json.gz where jax puts it: {process: {thread: [(name, ts, dur,
    args)]}}, times in microseconds."""
    events = []
    for pid, (process, threads) in enumerate(processes.items()):
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": process}})
        for tid, (thread, line) in enumerate(threads.items()):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                           "args": {"name": thread}})
            events += [{"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur,
                        **({"args": args} if args else {})} for name, ts, dur, args in line]
    folder = os.path.join(log_dir, "plugins", "profile", "2026_01_01_00_00_00")
    os.makedirs(folder)
    path = os.path.join(folder, "perfetto_trace.json.gz")
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": events}, f)
    return path


def test_gpu_trace_summary(tmp_path):
    # Two steps on two streams. Busy is the union [0, 150] + [500, 800] + [900, 1000] =
    # 550 us of 1000 us from the first kernel to the last (the kernels' durations add up
    # to 670: overlaps count once). The derived lines and the host never count as kernels.
    path = write_trace(tmp_path, {
        "/host:CPU": {"python": [("PjitFunction(train_step)", -1000, 5000, None)]},
        "/device:GPU:0": {
            "Stream #13(Kernel)": [(GEMM, 0, 100, {"hlo_op": "custom-call.3"}),
                                   ("loop_add_fusion", 100, 20, None),
                                   (GEMM, 500, 100, {"hlo_op": "custom-call.3"}),
                                   (SDPA, 600, 150, None)],
            "Stream #14(Kernel,MemcpyD2D)": [(NCCL, 50, 100, None), ("MemcpyD2D", 700, 100, None),
                                            ("loop_add_fusion", 900, 100, None)],
            "XLA Ops": [("fusion.1", 0, 120, {"long_name": LONG_NAME}),
                        ("custom-call.3", 500, 100, None), ("fusion.1", 900, 100, None)],
            "XLA Modules": [("jit_train_step(123)", 0, 1000, None)],
            "Steps": [("1", 0, 500, None), ("2", 500, 500, None)],
        },
    })
    summary = profiling.summarize_trace(str(tmp_path), steps=2)
    assert summary["trace"] == path and summary["device"] == "/device:GPU:0"
    assert summary["devices"] == 1
    assert summary["wall_ms"] == 0.5 and summary["busy_ms"] == 0.275
    assert summary["idle_fraction"] == 0.45
    assert summary["categories_ms"] == {"attention": 0.075, "collectives": 0.05, "matmul": 0.1,
                                        "memcpy/memset": 0.05, "other": 0.06}
    top = summary["top_kernels"]
    assert [row["name"] for row in top] == [GEMM, SDPA, "loop_add_fusion", NCCL, "MemcpyD2D"]
    assert top[0] == {"name": GEMM, "ms": 0.1, "calls": 1.0, "share": round(200 / 550, 4),
                      "hlo_op": "custom-call.3"}
    assert top[3]["calls"] == 0.5
    ops = summary["top_hlo_ops"]
    assert [(row["name"], row["ms"]) for row in ops] == [("fusion.1", 0.11), ("custom-call.3", 0.05)]
    assert ops[0]["long_name"] == LONG_NAME[:200]
    assert summary["lines_ms"] == {"Stream #13(Kernel)": 0.185, "Stream #14(Kernel,MemcpyD2D)": 0.15,
                                   "XLA Ops": 0.16, "XLA Modules": 0.5, "Steps": 0.5}
    with open(summary["kernels_csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [row["kernel"] for row in rows] == [row["name"] for row in top]  # all five
    assert rows[0]["category"] == "matmul" and float(rows[0]["ms_per_step"]) == 0.1


def test_kernels_from_undeclared_lines_when_no_stream_is_named(tmp_path):
    write_trace(tmp_path, {"/device:GPU:1": {"kernels": [("fusion", 0, 10, None)]},
                           "/device:GPU:0": {"compute": [(GEMM, 0, 30, None), ("fusion", 40, 10, None)],
                                             "XLA Ops": [("dot.1", 0, 1000, None)]}})
    summary = profiling.summarize_trace(str(tmp_path), steps=1)
    assert summary["device"] == "/device:GPU:0" and summary["devices"] == 2
    assert summary["busy_ms"] == 0.04 and summary["wall_ms"] == 0.05


def test_hlo_ops_from_the_kernels_without_an_xla_ops_line(tmp_path):
    write_trace(tmp_path, {"/device:GPU:0": {"Stream #7(Kernel)": [
        (GEMM, 0, 30, {"hlo_op": "custom-call.1"}), ("loop_fusion", 30, 10, {"hlo_op": "fusion.2"}),
        (GEMM, 40, 20, {"hlo_op": "custom-call.4"}), ("input_fusion", 60, 10, {"hlo_op": "fusion.2"})]}})
    summary = profiling.summarize_trace(str(tmp_path), steps=1)
    assert [(row["name"], row["ms"], row["calls"]) for row in summary["top_hlo_ops"]] == \
        [("custom-call.1", 0.03, 1.0), ("fusion.2", 0.02, 2.0), ("custom-call.4", 0.02, 1.0)]


def test_cpu_trace_reports_host_threads(tmp_path):
    # XLA:CPU: no device process; thunks (with hlo_op) nest inside the executor's events.
    write_trace(tmp_path, {"/host:CPU": {
        "python": [("PjitFunction(train_step)", 0, 5000, None)],
        "tf_XLAEigen/-61": [("ThunkExecutor::Execute", 0, 100, None),
                            ("dot.3", 10, 60, {"hlo_op": "dot.3"})],
        "tf_XLAEigen/42": [("dot.3", 0, 40, {"hlo_op": "dot.3"})],
        "tf_XLAPjRtCpuClient/7": [("fusion.2", 0, 20, {"hlo_op": "fusion.2"})],
    }})
    summary = profiling.summarize_trace(str(tmp_path), steps=2)
    assert summary["device"] is None and "no device" in summary["note"]
    assert summary["host_xla_threads_ms"] == {"tf_XLAEigen": 0.07, "tf_XLAPjRtCpuClient": 0.01}
    assert [(row["name"], row["ms"], row["share"]) for row in summary["top_hlo_ops"]] == \
        [("dot.3", 0.05, round(100 / 120, 4)), ("fusion.2", 0.01, round(20 / 120, 4))]


@pytest.mark.parametrize("name, category", [
    (GEMM, "matmul"), ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "matmul"),
    ("triton_gemm_dot_12", "matmul"), (SDPA, "attention"), ("ncclDevKernel_ReduceScatter_Sum", "collectives"),
    ("MemcpyH2D", "memcpy/memset"), ("input_reduce_fusion", "other"), ("loop_convert_fusion", "other"),
])
def test_kernel_categories(name, category):
    assert profiling.category(name) == category


def test_bench_profile_steps(tmp_path):
    result = run_bench("train", "--seq_length=16", "--batch_size=8", "--warmup_steps=1", "--steps=2",
                       "--llama.num_hidden_layers=1", "--profile_steps=2", f"--profile_dir={tmp_path}",
                       "--compilation_cache_dir=~/.cache/easylm/jax")  # the trainer's default
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["tokens_per_second"] > 0 and row["step_time_s"] > 0
    assert len(row["losses"]) == 1 + 2  # the profiled steps are not among them
    profile = row["profile"]
    assert profile["steps"] == 2 and profile["device"] is None  # XLA:CPU
    assert profile["traced_step_time_s"] > 0 and os.path.exists(profile["trace"])
    assert profile["host_xla_threads_ms"] and profile["top_hlo_ops"]
    assert run_bench("train", "--profile_steps=-1").stderr == \
        "error: --profile_steps must be >= 0, got -1\n"


def run_profiler(tmp_path, start, steps, fail_at=None):
    """A loop of 6 steps that calls the profiler as the trainer's does; its log lines."""
    lines = []
    profiler = profiling.Profiler(str(tmp_path), start, steps, log=lines.append)
    step_fn = jax.jit(lambda x: x * 2.0 + 1.0)
    x = jax.numpy.zeros(8)
    try:
        for step in range(1, 7):
            profiler.before(step)
            x = step_fn(x)
            profiler.after(step, x)
            assert profiler.active == (start <= step < start + steps - 1)
            if step == fail_at:
                raise RuntimeError("the step failed")
    finally:
        profiler.stop()
    return lines


def assert_no_trace_running(tmp_path):
    jax.profiler.start_trace(str(tmp_path / "check"))  # raises if one is still on
    jax.profiler.stop_trace()


def test_profiler_traces_its_window_also_when_the_loop_fails(tmp_path):
    (line,) = run_profiler(tmp_path / "ok", start=2, steps=3)
    trace = profiling.find_trace(str(tmp_path / "ok"))
    assert line.startswith(f"profile of 3 step(s) from step 2: {trace}; view it in ui.perfetto.dev")
    with pytest.raises(RuntimeError, match="the step failed"):
        run_profiler(tmp_path / "failed", start=2, steps=10, fail_at=3)
    assert profiling.find_trace(str(tmp_path / "failed"))
    assert_no_trace_running(tmp_path)


def test_trainer_run_that_ends_inside_the_window_keeps_its_trace(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    train.main(["train", "--total_steps=2", "--profile_start_step=2", "--profile_steps=5",
                "--llama.num_hidden_layers=1", "--train_dataset.json_dataset.batch_size=8",
                "--train_dataset.json_dataset.seq_length=32", f"--logger.output_dir={tmp_path}"])
    (run_dir,) = glob.glob(str(tmp_path / "llama-*"))
    (trace,) = glob.glob(f"{run_dir}/profile/process0/plugins/profile/*/perfetto_trace.json.gz")
    assert f"profile of 1 step(s) from step 2: {trace}" in capsys.readouterr().out
    summary = profiling.summarize_trace(f"{run_dir}/profile/process0", 1)
    assert summary["top_hlo_ops"]  # the step ran inside the trace
    assert_no_trace_running(tmp_path)


def test_trainer_bad_profile_flags(tmp_path, capsys):
    for flag, message in (("--profile_steps=-1", "--profile_steps must be >= 0, got -1"),
                          ("--profile_start_step=0", "--profile_start_step must be >= 1, got 0")):
        with pytest.raises(SystemExit) as e:
            train.main(["train", flag, f"--logger.output_dir={tmp_path}"])
        assert e.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"
    assert os.listdir(tmp_path) == []
