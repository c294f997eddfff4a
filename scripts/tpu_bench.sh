#!/usr/bin/env bash
# The TPU measurements on one v5e chip (JAX 0.10.2 there), in one device command of under
# 9 minutes: the kernels (splash vs XLA attention when this tree has attention=splash;
# the experts' grouped matmul, megablox vs ragged_dot), the small MoE's train step with
# each grouped matmul and its layer's parts, qwen3_0.6b's at seq 2048 (batch 8) and 8192
# (batch 2), llama_1b decode at batch 1/16/64, and 50 training steps of qwen3_0.6b with
# splash against xla when time is left. Runs go most important first; each gets at most
# what is left of the deadline (DEADLINE seconds from the start, default 500) and one
# that would start with under 40 s left is skipped, so the command ends in time and keeps
# what it measured.
# Run from the repository root through the device tool, carrying .whl-tpu (the project's
# wheels: qwix and the serving ones, bash ../shared/device/prepare_tpu_wheels.sh):
#   bash scripts/tpu_bench.sh 2>&1 | tee $OUT/tpu_bench.txt
# It installs the rest from the machine's own index into /tmp/site (once per machine).
# Prints one JSON line per measurement (also in $OUT/tpu_bench.jsonl); copy them into
# docs/benchmarks.md's TPU section with the date and commit.
set -uo pipefail
deadline=${DEADLINE:-500}
here=$(dirname "$0")
if [ ! -d /tmp/site/flax ]; then
  idx=/opt/pypi/simple; have=""
  for p in flax optax orbax-checkpoint ml-collections absl-py transformers tokenizers \
           sentencepiece datasets safetensors pyyaml tqdm fsspec jinja2 markupsafe opt-einsum; do
    [ -d $idx/$p ] && have="$have $p"
  done
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
    --index-url file://$idx --target /tmp/site $have
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
    --no-compile --target /tmp/site2 .whl-tpu/*.whl
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}:/tmp/site2:/tmp/site WANDB_MODE=disabled PYTHONUNBUFFERED=1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
results=${OUT:-/tmp}/tpu_bench.jsonl
: > "$results"
left() { echo $(( deadline - SECONDS )); }
# run CAP CMD...: CMD under a timeout of min(CAP, time left), or skipped.
run() {
  local cap=$1; shift
  local t; t=$(left); (( t > cap )) && t=$cap
  if (( t < 40 )); then echo "{\"skipped\": \"$*\", \"seconds_left\": $(left)}" | tee -a "$results"; return 1; fi
  local start=$SECONDS
  timeout "$t" "$@" > >(tee -a "$results") &
  local pid=$!
  # The machine's host memory (40 GB) is the run's too: a run that leaves under 3 GB of
  # it is stopped here, named, before the machine is taken away with every result.
  while kill -0 $pid 2>/dev/null; do
    if (( $(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo) < 3 )); then
      kill $pid; echo "{\"failed\": \"$*\", \"host_memory\": \"under 3 GB left\"}" | tee -a "$results"
    fi
    sleep 1
  done
  wait $pid
  local rc=$?
  echo "# $(( SECONDS - start )) s, exit $rc, $(left) s left" >&2
  (( rc == 0 )) || echo "{\"failed\": \"$*\", \"exit\": $rc}" | tee -a "$results"
  return $rc
}
bench() { run "${CAP:-120}" python3 -m easylm.bench train --compilation_cache_dir=/tmp/jax-cache \
            --dtype=bf16 --warmup_steps=2 --steps=10 "$@"; }

# The small MoE of issue 56: qwen3_30b_a3b's layer (32 heads of 128, 4 K/V heads, expert
# width 768) at 8 layers, d 1024, 32 experts, top 8: 0.99B parameters, held in bf16 with
# bf16 Adam moments (fp32 ones with the gradients would not leave room on 16 GB).
moe_flags="--llama.base_model=qwen3_30b_a3b --llama.num_hidden_layers=8 --llama.hidden_size=1024
  --llama.num_experts=32 --llama.num_experts_per_tok=8 --seq_length=2048 --batch_size=8
  --param_dtype=bf16 --optimizer.state_dtype=bf16 --llama.scan_layers=True
  --llama.remat_policy=nothing_saveable --llama.loss_chunk_size=1024"
qwen="--llama.base_model=qwen3_0.6b --param_dtype=fp32 --llama.scan_layers=True --llama.loss_chunk_size=1024"
attention=xla
python3 -c "from easylm.models.config import ATTENTION_IMPLEMENTATIONS as A; assert 'splash' in A" \
  2>/dev/null && attention=splash

# 1. The kernels: grouped matmul fwd+bwd (issue 56: ragged_dot 114, megablox 128 TFLOP/s
#    at the small MoE's shape), attention fwd+bwd (skipped without splash).
run 90 python3 "$here"/kernel_bench.py grouped_matmul
[ $attention = splash ] && run 90 python3 "$here"/kernel_bench.py attention
# 2. The small MoE's step, ragged_dot then megablox (issue 56: 13.9% MFU; target >= 30%;
#    30.8% with ragged_dot and splash on 2026-12-06), then where one layer's time goes.
CAP=100 bench $moe_flags --llama.attention=$attention --llama.moe_matmul=ragged_dot
CAP=110 bench $moe_flags --llama.attention=$attention --llama.moe_matmul=megablox
run 90 python3 "$here"/kernel_bench.py moe_layer
# 3. qwen3_0.6b at seq 2048, batch 8 (23.5% MFU with nothing_saveable and XLA attention):
#    the attention block's projections kept, the MLP recomputed; then at seq 8192.
CAP=110 bench $qwen --seq_length=2048 --batch_size=8 --llama.attention=$attention \
  --llama.remat_policy=save_attention_projections
CAP=110 bench $qwen --seq_length=8192 --batch_size=2 --llama.attention=$attention \
  --llama.remat_policy=nothing_saveable
CAP=100 bench $qwen --seq_length=2048 --batch_size=8 --llama.attention=$attention \
  --llama.remat_policy=offload_attention_projections
# 4. Decode: llama_1b, bf16, prompt 128, 256 new tokens.
run 150 python3 -m easylm.bench decode --llama.base_model=llama_1b --dtype=bf16 \
  --batch_sizes=1,16,64 --prompt_length=128 --new_tokens=256
# 5. splash against xla, 50 steps of qwen3_0.6b on the embedded corpus (~140 s on its own;
#    what the deadline leaves, so it may need a call of its own: docs/benchmarks.md).
[ $attention = splash ] && run 200 python3 "$here"/tpu_splash_losses.py --steps=50 -- \
  $qwen --llama.remat_policy=nothing_saveable --train_dataset.json_dataset.seq_length=1024 \
  --train_dataset.json_dataset.batch_size=8
echo "total $SECONDS s"
