"""GRPO with tools, end to end on CPU: a tiny LLaMA learns to call a tool that works.

    python scripts/recipe_tool_grpo.py [--workdir=/tmp/tool_grpo] [--sft_steps=...] ...

1. Writes the tests' tiny word-level tokenizer (tests/tool_chat.py: a Hermes-style chat
   template whose vocabulary holds whole tool calls as single tokens), a tools module
   (add works; boom raises; hang times out) and a rewards module.
2. SFT (`python -m easylm.train`, objective next_token) of a 2-layer debug LLaMA on
   conversations rendered with the tools: a quarter call add and answer its result, the
   rest call a failing tool, send bad JSON or answer without a call. The model learns
   the format and calls add now and then.
3. GRPO (`python -m easylm.train --objective=grpo --grpo.tools=...`) from the SFT's
   params, rewarded by `tool_success` (1.0 when a tool answered without error) and
   `answer` (1.0 when the final turn says what that tool answered).
4. Prints both rewards' mean over the first and the last steps of GRPO (metrics.jsonl).
"""

import argparse
import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from tool_chat import CALLS, TOOLS_MODULE, VOCAB, make_tokenizer

REWARDS_MODULE = '''
def tool_success(prompts, completions, **fields):
    """1.0 when some tool answered without an error."""
    return [float(any(m["role"] == "tool" and not m["content"].startswith("error")
                      for m in c)) for c in completions]


def answer(prompts, completions, **fields):
    """1.0 when the model's last turn says what a tool answered without error (a bare "5"
    without a call earns nothing: the answer must come from the tool)."""
    out = []
    for c in completions:
        results = [m["content"] for m in c if m["role"] == "tool"
                   and not m["content"].startswith("error")]
        said = [m["content"].strip() for m in c if m["role"] == "assistant"]
        out.append(float(bool(results) and said[-1] == results[-1].strip()))
    return out
'''
PROMPTS = ["the cat", "a dog is", "sun", "the dog is odd", "a cat is even", "the sun",
           "a dog", "the cat is odd"]
WORDS = ["the", "cat", "dog", "sun", "odd", "even", "a", "is"]


def conversation(rng, kind):
    """(prompt, messages after it) of one SFT example: a call that works, one that fails,
    bad JSON, or no call."""
    say = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
    call = f"<tool_call>{CALLS[kind]}</tool_call>" if kind != "none" else None
    if kind == "none":
        return [{"role": "assistant", "content": say}]
    result = {"ok": "5", "raise": "error: boom raised RuntimeError: kaboom",
              "bad_json": "error: the tool call is not valid JSON"}[kind]
    final = "5" if kind == "ok" else say
    return [{"role": "assistant", "content": call},
            {"role": "tool", "name": "add", "content": result},
            {"role": "assistant", "content": final}]


def write_inputs(workdir, examples, seed):
    from transformers.utils import get_json_schema

    os.makedirs(workdir, exist_ok=True)
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(os.path.join(workdir, "tokenizer"))
    with open(os.path.join(workdir, "recipe_tools.py"), "w") as f:
        f.write(TOOLS_MODULE)
    with open(os.path.join(workdir, "recipe_rewards.py"), "w") as f:
        f.write(REWARDS_MODULE)
    sys.path.insert(0, workdir)
    import recipe_tools

    schemas = [get_json_schema(f) for f in (recipe_tools.add, recipe_tools.boom)]
    rng = random.Random(seed)
    kinds = ["ok", "raise", "bad_json", "none"]
    with open(os.path.join(workdir, "sft.jsonl"), "w") as f:
        for i in range(examples):
            messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
            messages += conversation(rng, kinds[i % 4])
            text = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False)
            f.write(json.dumps({"text": text}) + "\n")
    with open(os.path.join(workdir, "prompts.jsonl"), "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 4)


def train(workdir, name, flags):
    env = dict(os.environ, WANDB_MODE="disabled",
               PYTHONPATH=os.pathsep.join([workdir, ROOT, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "easylm.train", *(f"--{k}={v}" for k, v in flags.items()),
               f"--logger.output_dir={workdir}", f"--logger.experiment_id={name}",
               "--compilation_cache_dir=", f"--llama.vocab_size={VOCAB}",
               "--llama.base_model=debug", f"--tokenizer={os.path.join(workdir, 'tokenizer')}"]
    print("+", " ".join(command[1:]), flush=True)
    subprocess.run(command, env=env, check=True, cwd=workdir)
    with open(os.path.join(workdir, name, "metrics.jsonl")) as f:
        merged = {}
        for line in map(json.loads, f.read().split("\n")[:-1]):
            merged.setdefault(line["step"], {}).update(line)
    return [merged[s] for s in sorted(merged)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/tmp/tool_grpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft_steps", type=int, default=150)
    parser.add_argument("--sft_lr", type=float, default=3e-3)
    parser.add_argument("--grpo_steps", type=int, default=30)
    parser.add_argument("--grpo_lr", type=float, default=3e-4)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--prompts_per_step", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--window", type=int, default=5, help="steps averaged at each end")
    args = parser.parse_args()
    write_inputs(args.workdir, 512, args.seed)
    seq = 64
    train(args.workdir, "sft", {
        "objective": "next_token", "train_dataset.json_dataset.path": "sft.jsonl",
        "train_dataset.json_dataset.seq_length": seq,
        "train_dataset.json_dataset.batch_size": 16,
        "train_dataset.text_processor.add_eos_token": False,
        "total_steps": args.sft_steps, "log_freq": 25, "save_model_freq": args.sft_steps,
        "optimizer.adamw_optimizer.lr": args.sft_lr,
        "optimizer.adamw_optimizer.lr_warmup_steps": 10,
        "optimizer.adamw_optimizer.lr_decay_steps": args.sft_steps + 1,
        "optimizer.adamw_optimizer.end_lr": args.sft_lr / 10, "seed": args.seed})
    sft = os.path.join(args.workdir, "sft", "checkpoints", str(args.sft_steps))
    steps = train(args.workdir, "grpo", {
        "objective": "grpo", "load_checkpoint": f"params::{sft}",
        "train_dataset.json_dataset.path": "prompts.jsonl",
        "train_dataset.json_dataset.seq_length": seq,
        "train_dataset.json_dataset.batch_size": args.prompts_per_step,
        "grpo.num_generations": args.num_generations, "grpo.max_new_tokens": 6,
        "grpo.max_turns": 3, "grpo.tool_timeout": 0.2, "grpo.beta": 0.0,
        "grpo.tools": "recipe_tools:add,boom,hang",
        "grpo.reward_funcs": "recipe_rewards:tool_success,recipe_rewards:answer",
        "grpo.temperature": args.temperature, "total_steps": args.grpo_steps, "log_freq": 1,
        "optimizer.adamw_optimizer.lr": args.grpo_lr,
        "optimizer.adamw_optimizer.lr_warmup_steps": 0,
        "optimizer.adamw_optimizer.lr_decay_steps": args.grpo_steps + 1,
        "optimizer.adamw_optimizer.end_lr": args.grpo_lr, "seed": args.seed})
    keys = ["rewards/tool_success/mean", "rewards/answer/mean", "data/rollout/tool_calls",
            "data/rollout/tool_errors", "data/rollout/turns_per_episode"]
    w = args.window
    print(f"GRPO, {len(steps)} steps of {args.prompts_per_step} prompts x "
          f"{args.num_generations} episodes: step 1 (the SFT model's rollouts), the mean of "
          f"the first {w} and of the last {w} steps")
    for k in keys:
        first = sum(s[k] for s in steps[:w]) / w
        last = sum(s[k] for s in steps[-w:]) / w
        print(f"  {k}: {steps[0][k]:.3f} | {first:.3f} -> {last:.3f}")
    print("tool_success per step:", [round(s[keys[0]], 2) for s in steps])


if __name__ == "__main__":
    main()
