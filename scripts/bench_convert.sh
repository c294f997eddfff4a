#!/usr/bin/env bash
# Peak memory of the HF -> easylm converter as a ratio of its output size.
#   [LAYERS=16] bash scripts/bench_convert.sh [WORKDIR]
# Builds a random ~1.1 GB (fp32) LLaMA in HF format, converts it under
# /usr/bin/time -v, and prints peak RSS / output size (target <= 1.5).
set -euo pipefail
work=${1:-$(mktemp -d)}
export JAX_PLATFORMS=cpu
python - "$work/hf" <<'PY'
import os, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                     num_hidden_layers=int(os.environ.get("LAYERS", 16)), num_attention_heads=16)
with torch.device("meta"):
    model = LlamaForCausalLM(config)
model = model.to_empty(device="cpu")
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.02)
model.save_pretrained(sys.argv[1])
PY
rm -rf "$work/out"
/usr/bin/time -v python -m easylm.llama.convert_hf_to_easylm --hf_model="$work/hf" \
    --output_dir="$work/out" 2> "$work/time.txt" >/dev/null
peak_kb=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$work/time.txt")
input_b=$(du -sb "$work/hf" | cut -f1)
output_b=$(du -sb "$work/out" | cut -f1)
wall=$(awk -F'): ' '/Elapsed \(wall clock\)/ {print $2}' "$work/time.txt")
python -c "
peak = $peak_kb * 1024; out = $output_b; inp = $input_b
print(f'input {inp/1e9:.2f} GB, output {out/1e9:.2f} GB, peak RSS {peak/1e9:.2f} GB, '
      f'peak/output = {peak/out:.2f}x, wall {\"$wall\"}')"
