"""Multi-turn rollouts: extending each episode's kept cache against re-prefilling its history.

    python scripts/bench_multiturn.py                    # the debug preset, 8 episodes
    python scripts/bench_multiturn.py --hidden_size=256 --layers=4 --episodes=16

Every episode runs --turns model turns of --turn_tokens sampled tokens (the random model
draws its EOS rarely; the environment answers whatever the model says), with an environment
message of --tool_tokens tokens after each turn but the last (easylm/objectives/
episodes.py, what `--grpo.tools` runs). Both ways sample the same tokens (same keys, same
positions):

kept       Engine.extend: the message's tokens prefilled onto the episode's cache at its
           position (GRPO's multi-turn rollouts)
reprefill  Engine.prefill of the whole conversation so far into the episode's slot at each
           turn (what a rollout without a kept cache runs)

Each is timed --repeats times after a warm-up (compilation), in turns; prints the medians
of sampled tokens/s, the prefill tokens per episode, and the ratio kept / reprefill.
"""

import argparse
import statistics
import time

import jax
import numpy as np
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from easylm.data.conversations import ChatRenderer
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.objectives import episodes as episodes_lib
from easylm.serving import engine as engine_lib

TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
            "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant {% endif %}")


class Echo:
    """An environment that answers each turn with `words` words, for `turns` turns."""

    def __init__(self, words: int, turns: int):
        self.words, self.turns, self.seen = words, turns, 0

    def reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, messages):
        self.seen += 1
        if self.seen >= self.turns:
            return [], None, True
        return [{"role": "tool", "content": " ".join(["w"] * self.words)}], None, False


def tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    words = ["<pad>", "<unk>", "<|im_end|>", "<|im_start|>", "user", "assistant", "tool", "w"]
    words += [f"t{i}" for i in range(vocab - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(w, special=True) for w in words[:4]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    return fast


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden_size", type=int, default=0)
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn_tokens", type=int, default=32)
    parser.add_argument("--tool_tokens", type=int, default=64)
    parser.add_argument("--prompt_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    shape = {k: v for k, v in (("hidden_size", args.hidden_size),
                               ("num_hidden_layers", args.layers)) if v}
    if args.hidden_size:
        shape["intermediate_size"] = 2 * args.hidden_size
    config = LLaMAConfig.from_preset("debug", vocab_size=512, **shape)
    model = FAMILY.bind(config)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    tok = tokenizer(512)
    renderer = ChatRenderer(tok, TEMPLATE, None, tok.eos_token_id)
    prompt = " ".join(["w"] * (args.prompt_tokens - 4))
    length = args.prompt_tokens + args.turns * (args.turn_tokens + args.tool_tokens + 8)
    S = 1 << (length - 1).bit_length()
    engine = engine_lib.Engine(engine_lib.get_default_config(
        {"batch_size": args.episodes, "seq_length": S, "decode_steps": 8,
         "min_bucket": 1 << (args.prompt_tokens - 1).bit_length()}), model, params)

    def run(keep: bool):
        engine.reset()
        episodes = []
        for _ in range(args.episodes):
            env = Echo(args.tool_tokens, args.turns)
            messages = env.reset({"prompt": prompt})
            ids = renderer.ids(messages, True)
            episodes.append(episodes_lib.Episode(env, messages, ids, [False] * len(ids),
                                                 [0.0] * len(ids)))
        sampling = engine_lib.Sampling.empty(args.episodes)
        sampling.keys[:] = np.arange(2 * args.episodes, dtype=np.uint32).reshape(-1, 2)
        sampling.temperature[:] = 1.0
        began = time.perf_counter()
        episodes_lib.run_episodes(engine, episodes, sampling, args.turn_tokens, args.turns,
                                  renderer, tok, keep_cache=keep)
        seconds = time.perf_counter() - began
        sampled = sum(sum(e.model) for e in episodes)
        return sampled / seconds, np.mean([e.prefilled for e in episodes]), \
            [e.tokens for e in episodes]

    results = {True: [], False: []}
    for keep in (True, False):  # warm-up: every program compiled
        run(keep)
    rows = {}
    for _ in range(args.repeats):
        for keep in (True, False):
            rate, prefilled, rows[keep] = run(keep)
            results[keep].append((rate, prefilled))
    kept, again = (statistics.median(r for r, _ in results[k]) for k in (True, False))
    print(f"episodes {args.episodes} x {args.turns} turns of {args.turn_tokens} tokens, "
          f"{args.tool_tokens}-token tool messages, prompt {args.prompt_tokens}, "
          f"seq_length {S}, {jax.devices()[0].platform}")
    print(f"kept cache  {kept:10.1f} sampled tokens/s, prefill {results[True][0][1]:.0f} "
          f"tokens/episode")
    print(f"reprefill   {again:10.1f} sampled tokens/s, prefill {results[False][0][1]:.0f} "
          f"tokens/episode")
    print(f"ratio kept / reprefill: {kept / again:.2f}; same rows: {rows[True] == rows[False]}")


if __name__ == "__main__":
    main()
