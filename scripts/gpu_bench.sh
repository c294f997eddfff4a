#!/usr/bin/env bash
# The GPU measurements (decode in bf16 and int8 beside HF's static cache, the
# llama_1b train step) on one H200, in one device command of under 9 minutes. Runs go most
# important first; each gets at most what is left of the deadline (DEADLINE seconds from
# the start, default 520), and a run that would start with under 45 s left is skipped, so
# the command always ends in time and keeps what it measured.
# `bash scripts/gpu_bench.sh round1` runs the first round's list instead (train step, then decode) (the 8B and
# 7B steps, compile times); `tune` the shorter list of variants the 2026-11-30 second lease
# compared (docs/benchmarks.md), with a profile of the first; `decode` batch-1 variants.
# Run from the repository root on the GPU machine, after
#   bash ../shared/device/prepare_wheels.sh fastapi starlette uvicorn annotated-doc typing-extensions qwix
# here (fills .whl/; carry .whl), with:
#   bash scripts/gpu_bench.sh 2>&1 | tee $OUT/gpu_bench.txt
# Prints one JSON line per measurement (also in $OUT/gpu_bench.jsonl); copy them into
# docs/benchmarks.md with the date.
set -uo pipefail
mode=${1:-round2}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export WANDB_MODE=offline PYTHONUNBUFFERED=1
# The 8B step needs more than jax's default 75% of the card.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
deadline=${DEADLINE:-520}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
results=${OUT:-/tmp}/gpu_bench.jsonl
: > "$results"
left() { echo $(( deadline - SECONDS )); }
# run CAP CMD...: CMD under a timeout of min(CAP, time left), or skipped.
run() {
  local cap=$1; shift
  local t; t=$(left); (( t > cap )) && t=$cap
  if (( t < 45 )); then echo "{\"skipped\": \"$*\", \"seconds_left\": $(left)}" | tee -a "$results"; return 1; fi
  local start=$SECONDS
  timeout "$t" "$@"
  local rc=$?
  echo "# $(( SECONDS - start )) s, exit $rc, $(left) s left" >&2
  return $rc
}
bench() { run "${CAP:-150}" python3 -m easylm.bench train "$@" --compilation_cache_dir=/tmp/jax-cache \
            | tee -a "$results"; [ "${PIPESTATUS[0]}" = 0 ] || echo "{\"failed\": \"$*\"}" | tee -a "$results"; }

one_b="--llama.base_model=llama_1b --seq_length=2048 --batch_size=8 --dtype=bf16 --param_dtype=fp32 --warmup_steps=2 --steps=18"
fast="--llama.attention=cudnn --llama.loss_chunk_size=2048"  # llama_1b: one loss chunk per row
big="--llama.attention=cudnn --llama.loss_chunk_size=1024"   # 8B and 7B, as measured on 2026-11-30
# Decode throughput: llama_1b, bf16, prompt 128, 256 new tokens. Each
# batch size builds its own engine and compiles its prefill and decode programs first.
# decode CAP [FLAGS...]: later flags override earlier ones.
decode() { local cap=$1; shift
           run "$cap" python3 -m easylm.bench decode --llama.base_model=llama_1b --dtype=bf16 \
             --batch_sizes=1,16,64 --prompt_length=128 --new_tokens=256 "$@" | tee -a "$results"; }

if [ "$mode" = round2 ]; then
  # Decode: batch 1/16/64, bf16 and int8 weights, and HF transformers'
  # static-cache generate on the same GPU, same weights and prompts, in one process.
  decode 240 --quantize=none,int8 --hf=true
  # Acceptance 2: the llama_1b step (target >= 60% MFU, <= 60 GB), profiled, then the
  # variants the profile points at: Triton GEMMs (fused casts), fused projections.
  one=$one_b" $fast"
  CAP=110 bench $one --profile_steps=3 --profile_dir=/tmp/profile-1b
  CAP=80 XLA_FLAGS=--xla_gpu_enable_triton_gemm=true bench $one
  CAP=70 bench $one --llama.fused_qkv=True --llama.fused_mlp=True
  # int8 decode with Triton GEMMs (they can fuse the dequantization into the matmul).
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=true decode 120 --quantize=int8 --hf=false --batch_sizes=1,64
  if [ -n "${OUT:-}" ]; then
    t=$(ls -t /tmp/profile-1b/plugins/profile/*/perfetto_trace.json.gz 2>/dev/null | head -n 1)
    [ -n "$t" ] && cp "$t" "$(dirname "$t")/kernels.csv" "$OUT"/
  fi
elif [ "$mode" = decode ]; then
  # Batch-1 decode (the target: >= 1,000 tokens/s), the steps of a call as a loop
  # and unrolled (--decode_unroll), then unrolled with fused projections; DEADLINE=400.
  # On a fresh machine one batch-1 process did not finish in 50 s (2026-11-30): jax and
  # CUDA start, parameter init and the compiles come before the timed generate.
  decode 110 --hf=false --batch_sizes=1
  decode 150 --hf=false --batch_sizes=1,64 --decode_unroll=True
  decode 110 --hf=false --batch_sizes=1 --decode_unroll=True --llama.fused_qkv=True --llama.fused_mlp=True
elif [ "$mode" = tune ]; then
  # The second command of 2026-11-30's second H200 lease (DEADLINE=430). The first one's
  # profile showed the loss head's two backward matmuls running as fp32 (TF32) GEMMs, 15.8
  # of 245 ms; they now take bf16 operands (losses.head_logits), and Triton GEMMs are off by
  # default on GPU (+1.1% then). The step with one loss chunk, profiled; again (noise);
  # Triton GEMMs back on; chunks of 1024; fused projections; decode.
  one=$one_b" --llama.attention=cudnn --llama.loss_chunk_size=2048"
  CAP=110 bench $one --profile_steps=3 --profile_dir=/tmp/profile-1b
  CAP=70 bench $one
  CAP=90 XLA_FLAGS=--xla_gpu_enable_triton_gemm=true bench $one
  CAP=90 bench $one_b --llama.attention=cudnn --llama.loss_chunk_size=1024
  CAP=70 bench $one --llama.fused_qkv=True --llama.fused_mlp=True
  decode 110 --hf=false
  if [ -n "${OUT:-}" ]; then  # the trace and its kernel table, for reading here
    t=$(ls -t /tmp/profile-1b/plugins/profile/*/perfetto_trace.json.gz 2>/dev/null | head -n 1)
    [ -n "$t" ] && cp "$t" "$(dirname "$t")/kernels.csv" "$OUT"/
  fi
elif [ "$mode" = round1 ]; then
# Train step: the llama_1b shape, the unoptimised path and the optimised one,
# 20 steps each (2 warm-up + 18 timed) on the same batch, so the loss curves compare.
# The unoptimised path recomputes everything: XLA attention keeps (B, N, T, S) scores per
# layer (XLA:CPU sizes the step without remat at 220 GB); remat does not change the numbers.
bench $one_b --llama.attention=xla --llama.remat_policy=nothing_saveable
bench $one_b $fast

# Train step at 8B: llama3_8b shape, seq 4096, bf16 parameters and moments. Saving the
# projections' outputs may not fit; then recompute everything.
for remat in checkpoint_dots_with_no_batch_dims nothing_saveable; do
  CAP=180 bench --llama.base_model=llama3_8b --seq_length=4096 --batch_size=2 --dtype=bf16 --param_dtype=bf16 \
    --optimizer.state_dtype=bf16 $big --llama.remat_policy=$remat --llama.scan_layers=True --steps=3
  tail -n 1 "$results" | grep -q '"llama3_8b"' && break
done

# Compile time: cold compile of llama_7b scanned, then a warm start from the cache.
# The JSON line's compile_time_s is lower+compile; the shell times the whole process.
rm -rf /tmp/jax-cache-7b
for start in cold warm; do
  t0=$(date +%s.%N)
  run 150 python3 -m easylm.bench train --llama.base_model=llama_7b --seq_length=2048 --batch_size=1 \
    --dtype=bf16 --param_dtype=bf16 --optimizer.state_dtype=bf16 --llama.scan_layers=True \
    --llama.remat_policy=nothing_saveable $big --steps=1 --warmup_steps=1 \
    --compilation_cache_dir=/tmp/jax-cache-7b | sed "s/^{/{\"run\": \"7b_$start\", /" | tee -a "$results"
  echo "{\"run\": \"7b_$start\", \"whole_process_s\": $(python3 -c "import time; print(round(time.time() - $t0, 2))")}" | tee -a "$results"
done

# llama_1b variants, as long as time is left: keep attention outputs; scanned layers.
bench $one_b $fast --llama.remat_policy=save_attention_out
bench $one_b $fast --llama.scan_layers=True
# On 2026-11-30 the decode run got 120 s and finished batch 1 only (compiles included).
decode 180
else
  echo "usage: bash scripts/gpu_bench.sh [round2|round1|tune|decode]" >&2; exit 2
fi

# Loss curves of the llama_1b runs against the first (unoptimised) one.
python3 - "$results" <<'PY'
import json, sys
rows = []
for line in open(sys.argv[1]):
    try:
        rows.append(json.loads(line))
    except ValueError:
        pass
for r in rows:
    p = r.get("profile")
    if p:  # where the profiled step's time went
        print("profile:", json.dumps({k: p.get(k) for k in (
            "traced_step_time_s", "wall_ms", "busy_ms", "idle_fraction", "categories_ms")}))
        for k in (p.get("top_kernels") or [])[:10]:
            print(f"  {k['ms']:8.2f} ms x{k['calls']:<6} {k['name'][:100]}")
runs = [r for r in rows if r.get("model") == "llama_1b" and "losses" in r]
for r in runs[1:]:
    diff = max(abs(a - b) for a, b in zip(r["losses"], runs[0]["losses"]))
    print(f"llama_1b {r['tokens_per_second']:.0f} tok/s, mfu {r['mfu']}, {r['peak_memory_gb']} GB: "
          f"max |loss - reference| over {len(r['losses'])} steps = {diff:.4f}")
PY
echo "total $SECONDS s"
