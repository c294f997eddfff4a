"""Multi-turn GRPO with tools (easylm/objectives/episodes.py, environments.py,
serving/engine.py `extend`): an episode's row is its sampled ids and the chat template's
deltas, exactly; only the model's tokens carry loss; a later turn decoded on the kept cache
has the log-probabilities of a fresh forward of the whole conversation; an episode's
prefill is its prompt and what was appended, never its history again; and tools that
raise, hang or get bad JSON are messages the model reads, through the train command.

The tokenizer is a tiny word-level one with a Hermes-style chat template (tools in the
system turn, tool results as <tool_response> in a user turn, <|im_end|> the EOS), whose
vocabulary holds whole tool calls as single tokens, so a random tiny LLaMA calls tools
often."""

import collections
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close, assert_differs, forward_rel, fp32_rel, max_error
from serving_utils import log_softmax
from tool_chat import TEMPLATE, TOOLS_MODULE, VOCAB, make_tokenizer
from transformers.utils import get_json_schema

from easylm.errors import UserError
from easylm.llama.config import LLaMAConfig
from easylm.llama.model import LLaMAForCausalLM
from easylm.objectives import environments, episodes as episodes_lib, grpo
from easylm.serving import engine as engine_lib


@pytest.fixture(scope="module")
def tools_module(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grpo-tools")
    (directory / "grpo_test_tools.py").write_text(TOOLS_MODULE)
    sys.path.insert(0, str(directory))
    import grpo_test_tools

    yield directory, grpo_test_tools
    sys.path.remove(str(directory))


def tool_engine(family, model, config, module):
    """(params, tokenizer, renderer, engine, tools): `model` drawn at random, served with the
    test's tools rendered through the Hermes template."""
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    functions = [module.add, module.boom, module.hang]
    renderer = episodes_lib.ChatRenderer(make_tokenizer(), TEMPLATE,
                                         [get_json_schema(f) for f in functions], 2)
    return params, renderer.tokenizer, renderer, engine_lib.Engine(ENGINE, family.bind(config),
                                                                    params), functions


S = 64  # the row: every episode's tokens


@pytest.fixture(scope="module")
def rollouts(tools_module):
    """(model, params, tokenizer, renderer, {keep_cache: episodes}, engine): 8 episodes of
    up to 3 turns of <= 6 tokens, sampled at temperature 1 on one engine, once extending
    the kept cache and once re-prefilling each conversation."""
    from easylm.llama.family import FAMILY

    config = LLaMAConfig.from_preset("debug", vocab_size=VOCAB, initializer_range=0.05)  # flat
    model = LLaMAForCausalLM(config)
    params, tokenizer, renderer, engine, functions = tool_engine(FAMILY, model, config,
                                                                 tools_module[1])
    out = {keep: roll(engine, renderer, tokenizer, functions, keep) for keep in (True, False)}
    return model, params, tokenizer, renderer, out, engine


ENGINE = engine_lib.get_default_config(
    {"batch_size": 8, "seq_length": S, "decode_steps": 4, "min_bucket": 32})


def roll(engine, renderer, tokenizer, functions, keep: bool):
    """8 episodes of up to 3 turns of <= 6 tokens at temperature 1 (fixed keys)."""
    engine.reset()
    eps = []
    for i in range(8):
        env = environments.ToolEnvironment(functions, timeout=0.2)
        messages = env.reset({"prompt": ["the cat", "a dog is", "sun"][i % 3]})
        ids = renderer.ids(messages, True)
        eps.append(episodes_lib.Episode(env, list(messages), ids, [False] * len(ids),
                                        [0.0] * len(ids)))
    sampling = engine_lib.Sampling.empty(8)
    sampling.keys[:] = np.arange(16, dtype=np.uint32).reshape(8, 2)
    sampling.temperature[:] = 1.0
    episodes_lib.run_episodes(engine, eps, sampling, 6, 3, renderer, tokenizer,
                              keep_cache=keep)
    return eps


def multi_turn(eps):
    chosen = [e for e in eps if e.turns >= 2 and False in e.model[e.prompt_length:]]
    assert chosen, "no episode called a tool: nothing to test"
    return chosen


def model_runs(e) -> list[list[int]]:
    """The episode's runs of model tokens: its turns as sampled."""
    runs, run = [], []
    for t, m in zip(e.tokens, e.model):
        if m:
            run.append(t)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


def test_rows_are_the_sampled_ids_and_the_template_deltas(rollouts):
    """Each row is, id for id, the chat template's text of its whole conversation, the
    text between the model's turns tokenized, each turn the ids it sampled (whatever their
    text: a sampled <pad> stays), its EOS sampled or, when cut, context. The tools' answers
    are all there: a result, an exception, a timeout and bad JSON, each a tool message."""
    _, _, tokenizer, renderer, out, _ = rollouts
    contents = []

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    for e in out[True]:
        text = tokenizer.apply_chat_template(
            e.messages, tools=renderer.schemas, chat_template=TEMPLATE, tokenize=False,
            add_generation_prompt=e.messages[-1]["role"] != "assistant")
        said = [m["content"] for m in e.messages if m["role"] == "assistant"]
        runs = model_runs(e)
        assert len(runs) == len(said) == e.turns
        expected, at, opener = [], 0, "<|im_start|>assistant "
        for run, content in zip(runs, said):
            j = text.index(opener, at) + len(opener)
            assert text[j:j + len(content)] == content
            expected += encode(text[at:j]) + run
            at = j + len(content)
            if run[-1] == 2:  # the sampled EOS is the template's <|im_end|>
                assert text.startswith("<|im_end|>", at)
                at += len("<|im_end|>")
            assert tokenizer.decode(run, skip_special_tokens=True) == content
        expected += encode(text[at:])
        assert e.tokens == expected[:len(e.tokens)]
        assert len(expected) - len(e.tokens) <= (0 if e.ended_by_eos else 1)  # a cut EOS
        contents += [m["content"] for m in e.messages if m["role"] == "tool"]
    multi_turn(out[True])
    for expected in ("5", "error: boom raised RuntimeError: kaboom",
                     "error: the call to hang timed out after 0.2 s",
                     "error: the tool call is not valid JSON"):
        seen = collections.Counter(c[:30] for c in contents)
        assert any(c.startswith(expected) for c in contents), (expected, seen)


def test_only_the_models_tokens_carry_loss(rollouts):
    """episode_rows puts loss on the model's tokens: changing the policy's log-probabilities
    at the prompt and the tools' tokens leaves the GRPO loss bitwise as it was. Negative
    twin: with the tools' tokens weighted, the same change moves it."""
    eps = multi_turn(rollouts[4][True])
    rows = episodes_lib.episode_rows(eps, S, 0, np.ones(len(eps), bool))
    masks = rows["loss_masks"]
    for e, m, target in zip(eps, masks, rows["target_tokens"]):
        assert m.sum() == sum(e.model)
        assert (target[m > 0] == np.asarray(e.tokens)[np.asarray(e.model)]).all()
    rng = np.random.default_rng(0)
    logps = -rng.uniform(0.1, 3, masks.shape).astype(np.float32)
    context = np.zeros_like(masks)
    for i, e in enumerate(eps):
        context[i, e.prompt_length - 1:len(e.tokens) - 1] = 1 - masks[i, e.prompt_length - 1:
                                                                        len(e.tokens) - 1]
    assert context.sum() > 0
    moved = logps - 5.0 * context
    o = grpo.get_default_config({"num_iterations": 2})
    adv, old = rng.normal(size=len(eps)).astype(np.float32), logps + 0.1

    def loss(lp, m):
        sums = grpo.grpo_sums(jnp.asarray(lp), jnp.asarray(old), None, jnp.asarray(adv),
                              jnp.asarray(m), jnp.ones(len(eps)), o)
        return float(sums.loss / sums.weight)

    assert loss(moved, masks) == loss(logps, masks)
    weighted = masks + context
    assert loss(moved, weighted) != loss(logps, weighted)


def test_later_turns_on_the_kept_cache_are_a_fresh_forward(rollouts):
    """The engine's log-probability of every sampled token, later turns included (decoded
    on the cache the tools' answers were prefilled onto), equals a full forward of the
    whole conversation without a cache. Tolerance: the forward's fp32 reordering
    (numerics.forward_rel) of the log-probabilities' magnitude. Negative twin: the same
    forward with the tools' tokens blanked (what a cache that missed them would see)."""
    model, params, _, _, out, _ = rollouts
    check_later_turns(model, params, out[True], forward_rel(model.config, S))


def later_turns(model, params, e):
    """(the engine's log-probabilities of the model's tokens from turn 2 on, a full
    forward's, the same forward's with the tools' tokens blanked)."""
    ids = np.asarray(e.tokens)
    later = np.zeros(len(ids), bool)
    later[e.prompt_length:] = np.asarray(e.model[e.prompt_length:])
    first_context = e.prompt_length + e.model[e.prompt_length:].index(False)
    later[:first_context] = False  # turn 2 on: after the first tool answer
    assert later.any()
    where = np.flatnonzero(later)
    full = log_softmax(model, params, ids, S)
    blanked = ids.copy()
    blanked[first_context:][~np.asarray(e.model[first_context:])] = 0
    twin = log_softmax(model, params, blanked, S)
    return np.asarray(e.logprobs)[where], full[where - 1, ids[where]], \
        twin[where - 1, ids[where]]


def check_later_turns(model, params, eps, rel: float):
    for e in multi_turn(eps):
        got, expected, twin = later_turns(model, params, e)
        assert_close(got, expected, rel)
        assert_differs(got, twin, rel, scale=float(np.abs(expected).max()))


def test_a_recurrent_state_model_continues_its_turns(tools_module, monkeypatch):
    """Qwen3.5 (a Gated DeltaNet layer, whose cache is a recurrent state that cannot be
    rewound, and a full-attention one): the same rollouts on the kept cache, every later
    turn's log-probabilities a full forward's (the fp32 reordering of its 13 reductions a
    layer, as tests/test_qwen3_5.py). Turns end mid-call (EOS, max_new_tokens) and wait
    while others decode: the engine holds each slot's state there. Negative twin, off the
    full forward: decode calls that hold only the waiting slots' state (a turn's state
    still runs past its end in the call it ended in, and in the call sent before the host
    read it; tests/test_qwen3_5.py has the twin that holds nothing)."""
    from easylm.qwen3_5.family import FAMILY
    from easylm.qwen3_5.model import Qwen35ForCausalLM

    config = FAMILY.from_preset("debug", num_hidden_layers=2, full_attention_interval=2,
                                vocab_size=VOCAB, initializer_range=0.05)
    model = Qwen35ForCausalLM(config)
    params, tokenizer, renderer, engine, functions = tool_engine(FAMILY, model, config,
                                                                 tools_module[1])
    assert engine.layout.has_state
    rel = fp32_rel(max(config.hidden_size, config.intermediate_size, S, 64),
                   12 * config.num_hidden_layers + 1)
    check_later_turns(model, params, roll(engine, renderer, tokenizer, functions, True), rel)

    decode = engine.decode
    monkeypatch.setattr(engine, "decode", lambda sampling, active=None, keep=0, ends=None,
                        stop=-1: decode(sampling, active, keep))
    off = []
    for e in multi_turn(roll(engine, renderer, tokenizer, functions, True)):
        got, expected, _ = later_turns(model, params, e)
        off.append(max_error(got, expected) / float(np.abs(expected).max()))
    assert max(off) > rel, (off, rel)


def test_an_episode_prefills_its_prompt_and_appended_tokens_only(rollouts):
    """Kept cache: the tokens an episode ran through prefill are exactly its context tokens
    (the prompt, each tool answer's delta). Negative twin: re-prefilling each conversation
    runs its history again: more, by the history's length at each turn; the same rows."""
    eps, again = rollouts[4][True], rollouts[4][False]
    for e in eps:
        assert e.prefilled == e.model.count(False)
    multi_turn(eps)
    for e, r in zip(eps, again):
        if e.turns < 2:
            continue
        assert r.tokens == e.tokens  # same keys, same positions: the same samples
        assert r.prefilled > r.model.count(False)
        # Each later turn prefilled the whole row up to its first sampled token.
        resumed = [i for i in range(e.prompt_length + 1, len(r.model))
                   if r.model[i] and not r.model[i - 1]]
        assert r.prefilled == e.prompt_length + sum(resumed)


def test_extend_continues_a_waiting_slots_cache_while_others_decode(rollouts):
    """Engine level: slot 0 holds a 40-token history and waits (a tool runs) while slot 1
    decodes short calls, whose cache window (32 positions) ends inside slot 0's history;
    then slot 0's cache is extended by a suffix. The next token's top log-probabilities
    equal a fresh forward of history + suffix (fp32 forward tolerance). Negative twin:
    without `keep`, the idle slot's decode writes land inside its history (position 31)."""
    model, params, _, _, _, engine = rollouts  # its programs, compiled by the rollouts
    history = [3] + list(np.random.RandomState(0).randint(4, VOCAB, 39))
    sampling = engine_lib.Sampling.empty(1)
    sampling.temperature[:] = 1.0
    every = sampling.pad(engine.batch_size)
    active = np.arange(engine.batch_size) == 1
    got = {}
    for keep in (True, False):
        engine.reset()
        first = int(engine.fetch(engine.prefill([history], [0], sampling))[0][0, 0])
        engine.fetch(engine.prefill([[3, 5, 7, 9]], [1], sampling))
        for _ in range(3):  # slot 1 alone: a window of 32 positions
            engine.fetch(engine.decode(every, active, keep=41 if keep else 0))
        suffix = [first, 9, 10, 11]  # the sampled token, then an appended message
        out = engine.fetch(engine.extend([suffix], [0], [40], sampling))
        got[keep] = out[2][0, 0], out[3][0, 0]  # top ids, top log-probabilities
    ids, logps = got[True]
    full = log_softmax(model, params, history + suffix, S)[-1]
    rel = forward_rel(model.config, S)
    assert_close(logps, full[ids], rel)
    twin_ids, twin = got[False]
    assert_differs(twin, full[twin_ids], rel, scale=float(np.abs(full[ids]).max()))


def test_a_template_that_rewrites_earlier_turns_is_one_line():
    """A template that renders only the last assistant turn (as templates that drop earlier
    turns' reasoning do) is not prefix-stable: the delta is refused in one line."""
    tokenizer = make_tokenizer()
    forgetful = ("{%- for m in messages %}{%- if m['role'] != 'assistant' or loop.last %}"
                 "<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{%- endif %}"
                 "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant {% endif %}")
    chat = [{"role": "user", "content": "the"}, {"role": "assistant", "content": "cat"}]
    tool = [{"role": "tool", "content": "5"}]
    assert episodes_lib.ChatRenderer(tokenizer, TEMPLATE, None, 2).delta(chat, tool, True)
    with pytest.raises(UserError, match="^the chat template is not prefix-stable"):
        episodes_lib.ChatRenderer(tokenizer, forgetful, None, 2).delta(chat, tool, True)


def test_a_template_without_tools_is_told():
    """renders_tools: what the start-up line (the template ignores tools=) is decided by."""
    add = get_json_schema(add_one)
    assert episodes_lib.ChatRenderer(make_tokenizer(), TEMPLATE, [add], 2).renders_tools()
    plain = TEMPLATE[TEMPLATE.index("{%- for m"):]
    assert not episodes_lib.ChatRenderer(make_tokenizer(), plain, [add], 2).renders_tools()


def add_one(a: int) -> int:
    """Adds one.

    Args:
        a: the number
    """
    return a + 1


def test_parse_tool_calls_formats():
    hermes = 'x <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert environments.parse_tool_calls(hermes) == [("add", {"a": 1})]
    llama = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}'
    assert environments.parse_tool_calls(llama) == [("add", {"a": 1})]
    assert environments.parse_tool_calls("no call here") == []
    (name, error), = environments.parse_tool_calls("<tool_call>{oops</tool_call>")
    assert name is None and error.startswith("error: the tool call is not valid JSON")


@pytest.mark.parametrize("flags,message", [
    ({"tools": "no_such_module_x:f"}, "--grpo.tools=no_such_module_x:f: cannot import"),
    ({"tools": "grpo_test_tools:nope"}, "--grpo.tools=grpo_test_tools:nope: module"),
    ({"environment": "grpo_test_tools:add"},
     "--grpo.environment=grpo_test_tools:add: the class has no reset()"),
    ({"tools": "grpo_test_tools:add", "environment": "x:Y"},
     "--grpo.tools and --grpo.environment are exclusive"),
])
def test_unknown_tools_are_one_line_naming_the_flag(tools_module, flags, message):
    options = grpo.get_default_config(flags)
    with pytest.raises(UserError, match="^" + re.escape(message)):
        environments.load(options)


def test_train_command_runs_on_through_failing_tools(tools_module, tmp_path, monkeypatch):
    """python -m easylm.train --objective=grpo --grpo.tools=...: tools that raise, hang past
    --grpo.tool_timeout, and calls with bad JSON each come back as a tool message, and the
    run trains its steps on."""
    from test_checkpoint import metrics

    from easylm import train

    tokenizer_dir = tmp_path / "tokenizer"
    make_tokenizer().save_pretrained(tokenizer_dir)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the cat", "a dog"] * 8))
    seen = []
    step = environments.ToolEnvironment.step

    def recorded(self, messages):
        out = step(self, messages)
        seen.extend(m["content"] for m in out[0])
        return out

    monkeypatch.setattr(environments.ToolEnvironment, "step", recorded)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    flags = {"objective": "grpo", "llama.base_model": "debug", "llama.num_hidden_layers": 1,
             "llama.vocab_size": VOCAB, "tokenizer": str(tokenizer_dir),
             "train_dataset.json_dataset.path": str(data),
             "train_dataset.json_dataset.seq_length": S,
             "train_dataset.json_dataset.batch_size": 8, "grpo.num_generations": 2,
             "grpo.max_new_tokens": 6, "grpo.max_turns": 3, "grpo.tool_timeout": 0.2,
             "grpo.tools": "grpo_test_tools:add,boom,hang", "grpo.reward_funcs": "format",
             "grpo.temperature": 1.5,  # (not 1: no scoring program to compile)
             "grpo.format_pattern": ".*cat.*", "total_steps": 2, "log_freq": 1,
             "compilation_cache_dir": "", "logger.output_dir": str(tmp_path),
             "logger.experiment_id": "run"}
    train.main(["train", *(f"--{k}={v}" for k, v in flags.items())])
    got = metrics(tmp_path)
    assert sorted(got) == [1, 2]
    for key in ("data/rollout/turns_per_episode", "data/rollout/prefill_tokens_per_episode",
                "data/rollout/tool_calls", "data/rollout/tool_errors"):
        assert isinstance(got[2][key], float), key
    for expected in ("error: boom raised", "error: the call to hang timed out",
                     "error: the tool call is not valid JSON"):
        assert any(c.startswith(expected) for c in seen), (expected, seen)
