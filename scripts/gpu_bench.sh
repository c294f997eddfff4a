#!/usr/bin/env bash
# All GPU measurements of issue 8 (train step) and issue 7 (decode) on one H200, in two parts
# of about 5 minutes each, so that each fits one 10-minute device command:
#   part 1: llama_1b train step (reference and optimised variants, loss curves) and decode
#   part 2: llama3_8b at seq 4096, llama_7b cold and warm compile
# Run from the repository root on the GPU machine, after
#   bash ../shared/device/prepare_wheels.sh fastapi uvicorn   (here, fills .whl/; carry .whl)
# with:  bash scripts/gpu_bench.sh 1 2>&1 | tee $OUT/gpu_bench1.txt   (then the same with 2;
# no argument runs both). Prints one JSON line per measurement; copy them into
# docs/benchmarks.md with the date.
set -uo pipefail
part=${1:-all}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export WANDB_MODE=offline
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
results=${OUT:-/tmp}/gpu_bench$part.jsonl
: > "$results"
bench() { timeout "${T:-150}" python3 -m easylm.bench train "$@" --compilation_cache_dir=/tmp/jax-cache \
            | tee -a "$results" || echo "{\"failed\": \"$*\"}"; }
if [ "$part" != 2 ]; then
shape="--llama.base_model=llama_1b --seq_length=2048 --batch_size=8 --dtype=bf16 --param_dtype=fp32"
# Issue 8 acceptance 1: the llama_1b shape, the reference path and the optimised one.
# 20 steps each (2 warm-up + 18 timed) on the same batch, so the loss curves compare.
shape="$shape --warmup_steps=2 --steps=18"
# The reference recomputes everything: XLA attention keeps (B, N, T, S) scores per layer
# (XLA:CPU sizes the step without remat at 220 GB), and remat does not change the numbers.
bench $shape --llama.attention=xla --llama.remat_policy=nothing_saveable
bench $shape --llama.attention=cudnn --llama.loss_chunk_size=1024
bench $shape --llama.attention=cudnn --llama.loss_chunk_size=1024 --llama.remat_policy=save_attention_out
bench $shape --llama.attention=cudnn --llama.loss_chunk_size=1024 --llama.scan_layers=True
# Issue 7 acceptance 6: decode throughput at batch 1, 16, 64 (llama_1b, bf16, prompt 128, 256 new).
timeout 150 python3 -m easylm.bench decode --llama.base_model=llama_1b --dtype=bf16 \
  --batch_sizes=1,16,64 --prompt_length=128 --new_tokens=256 || echo '{"failed": "decode"}'
fi
if [ "$part" != 1 ]; then
# Issue 8 acceptance 2: llama3_8b shape, seq 4096, bf16 parameters and moments. Saving the
# projections' outputs (XLA:CPU sizes it at 156 GB with XLA attention) may not fit; then
# recompute everything (119 GB there).
for remat in checkpoint_dots_with_no_batch_dims nothing_saveable; do
  T=200 bench --llama.base_model=llama3_8b --seq_length=4096 --batch_size=2 --dtype=bf16 --param_dtype=bf16 \
    --optimizer.state_dtype=bf16 --llama.attention=cudnn --llama.loss_chunk_size=1024 \
    --llama.remat_policy=$remat --llama.scan_layers=True --steps=3
  tail -n 1 "$results" | grep -q '"llama3_8b"' && break
done
# Issue 8 acceptance 3: cold compile of llama_7b scanned, then a warm start from the cache.
rm -rf /tmp/jax-cache-7b
for run in cold warm; do
  TIMEFORMAT="$run: whole process (start, init, compile, 2 steps) %R s"
  time timeout 200 python3 -m easylm.bench train --llama.base_model=llama_7b --seq_length=2048 --batch_size=1 \
    --dtype=bf16 --param_dtype=bf16 --optimizer.state_dtype=bf16 --llama.scan_layers=True --llama.remat_policy=nothing_saveable \
    --llama.attention=cudnn --steps=1 --warmup_steps=1 --compilation_cache_dir=/tmp/jax-cache-7b \
    | sed "s/^/$run: /"
done
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
runs = [r for r in rows if r.get("model") == "llama_1b" and "losses" in r]
for r in runs[1:]:
    diff = max(abs(a - b) for a, b in zip(r["losses"], runs[0]["losses"]))
    print(f"llama_1b {r['tokens_per_second']:.0f} tok/s, mfu {r['mfu']}: max |loss - reference| "
          f"over {len(r['losses'])} steps = {diff:.4f}")
PY
