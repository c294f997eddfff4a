#!/usr/bin/env bash
# The losses of five short runs on the debug presets, printed to the last digit: refactors of
# the model kit (the family kit, the narrow model contract) must leave them bitwise
# unchanged. Run it on two commits and diff the output:
#   bash scripts/kit_losses.sh > after.txt; git worktree add /tmp/base eab95cc
#   (cd /tmp/base && PYTHONPATH=$PWD bash scripts/kit_losses.sh) > before.txt; diff before.txt after.txt
# GRPO_FLAGS adds flags to the GRPO run: a GRPO step with beta > 0 differs from eab95cc's on
# purpose (TRL's KL bias correction, and the KL taken against the policy the
# rollout scored); GRPO_FLAGS=--grpo.beta=0 compares the rest of its path bitwise.
set -euo pipefail
out=$(mktemp -d)
python - "$out" <<'PY'
import json, random, sys
d = sys.argv[1]
rng = random.Random(0)
words = ["cat", "dog", "owl", "fox", "bee", "ant", "elk", "yak"]
with open(f"{d}/pairs.jsonl", "w") as f:
    for _ in range(64):
        a, b = rng.sample(words, 2)
        f.write(json.dumps({"prompt": f"the {a} and", "chosen": f" the {b} ran.",
                            "rejected": f" a {a} {b} sat."}) + "\n")
with open(f"{d}/prompts.jsonl", "w") as f:
    for _ in range(64):
        x, y = rng.randint(1, 9), rng.randint(1, 9)
        f.write(json.dumps({"prompt": f"{x} plus {y} is", "answer": str(x + y)}) + "\n")
PY
common=(--tokenizer=embedded --log_freq=1 --total_steps=4 --dtype=fp32 --save_model_freq=0
        --compilation_cache_dir= --logger.output_dir="$out/runs")
small=(--train_dataset.json_dataset.seq_length=64 --train_dataset.json_dataset.batch_size=8)
run() {  # NAME ARGS...: the run's losses, one line
  local name=$1; shift
  python -m easylm.train "${common[@]}" --logger.experiment_id="$name" "$@" >"$out/$name.log" 2>&1 \
    || { cat "$out/$name.log"; exit 1; }
  python -c "import json,sys; print(sys.argv[1], [json.loads(l)['loss'] for l in open(sys.argv[2]) if '\"loss\"' in l])" \
    "$name" "$out/runs/$name/metrics.jsonl"
}
run lora --llama.base_model=debug --lora.rank=4 "${small[@]}"
run dpo --llama.base_model=debug --objective=dpo --train_dataset.preference.enabled=True \
  --train_dataset.json_dataset.path="$out/pairs.jsonl" "${small[@]}"
run grpo --llama.base_model=debug --llama.num_hidden_layers=1 --objective=grpo --grpo.beta=0.04 \
  --grpo.num_generations=4 --grpo.max_new_tokens=8 --grpo.reward_funcs=answer_match \
  --train_dataset.json_dataset.path="$out/prompts.jsonl" \
  --train_dataset.json_dataset.seq_length=24 --train_dataset.json_dataset.batch_size=8 \
  ${GRPO_FLAGS:-}
run gemma --family=gemma --gemma.base_model=debug "${small[@]}"
run scanned --llama.base_model=debug --llama.scan_layers=True "${small[@]}"
rm -rf "$out"
