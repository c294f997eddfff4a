"""The same training run twice, attention=splash and attention=xla, and their losses step
by step (one JSON line per run, then one comparing them). Meant for a TPU (issue 56: 50
steps of qwen3_0.6b on the embedded corpus, splash against the XLA path):

    python scripts/tpu_splash_losses.py --steps=50 -- --llama.base_model=qwen3_0.6b ...

Everything after `--` goes to `python -m easylm.llama.train` for both runs. Each run is
stopped once its last step is logged (its final checkpoint is not needed here).
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile


def losses(attention: str, steps: int, flags: list[str], out: str) -> dict[int, float]:
    command = [sys.executable, "-m", "easylm.llama.train", f"--llama.attention={attention}",
               f"--total_steps={steps}", "--log_freq=1", f"--logger.output_dir={out}",
               f"--logger.experiment_id={attention}", *flags]
    found = {}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as run:
        for line in run.stdout:  # "step 7 | loss 9.1234 | ..."
            print(line, end="", file=sys.stderr)
            if line.startswith("step ") and "| loss " in line:
                step = int(line.split()[1])
                found[step] = float(line.split("| loss ")[1].split()[0])
                if step == steps:
                    run.terminate()
                    break
    # the printed loss has 4 decimals; metrics.jsonl has every digit
    with open(f"{out}/{attention}/metrics.jsonl") as f:
        for row in map(json.loads, f):
            if "loss" in row and row["step"] in found:
                found[row["step"]] = row["loss"]
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("flags", nargs="*", help="python -m easylm.llama.train's flags")
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="splash-losses-")
    runs = {}
    for kind in ("splash", "xla"):  # each printed as it ends (a timeout keeps the first)
        runs[kind] = found = losses(kind, args.steps, args.flags, out)
        print(json.dumps({"bench": "train_losses", "attention": kind,
                          "losses": [round(found[s], 6) for s in sorted(found)]}), flush=True)
    common = sorted(set(runs["splash"]) & set(runs["xla"]))
    diff = [abs(runs["splash"][s] - runs["xla"][s]) for s in common]
    worst = max(range(len(diff)), key=diff.__getitem__) if diff else None
    print(json.dumps({"bench": "train_losses_compared", "steps": len(common),
                      "max_abs_difference": None if worst is None else round(diff[worst], 6),
                      "at_step": None if worst is None else common[worst],
                      "step1_abs_difference": round(diff[0], 6) if diff else None,
                      "finite": all(map(math.isfinite, runs["splash"].values()))}))


if __name__ == "__main__":
    main()
