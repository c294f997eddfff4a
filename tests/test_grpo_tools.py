"""Multi-turn GRPO with tools (easylm/objectives/episodes.py, easylm/data/environments.py
and conversations.py, serving/engine.py `extend`): an episode's row is its sampled ids
and the chat template's deltas, exactly; only the model's tokens carry loss; a later turn
decoded on the kept cache has the log-probabilities of a fresh forward of the whole
conversation; an episode's prefill is its prompt and what was appended, never its history
again; and tools that raise, hang or get bad JSON are messages the model reads, through
the train command.

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

from easylm.data import environments
from easylm.data.conversations import ChatRenderer
from easylm.errors import UserError
from easylm.llama.config import LLaMAConfig
from easylm.llama.model import LLaMAForCausalLM
from easylm.objectives import episodes as episodes_lib, grpo
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
    schemas = [get_json_schema(f) for f in functions]
    renderer = ChatRenderer(make_tokenizer(), TEMPLATE, schemas, 2)
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
    assert ChatRenderer(tokenizer, TEMPLATE, None, 2).delta(chat, tool, True)
    with pytest.raises(UserError, match="^the chat template is not prefix-stable"):
        ChatRenderer(tokenizer, forgetful, None, 2).delta(chat, tool, True)


def test_a_template_without_tools_is_told():
    """renders_tools: what the start-up line (the template ignores tools=) is decided by."""
    add = get_json_schema(add_one)
    assert ChatRenderer(make_tokenizer(), TEMPLATE, [add], 2).renders_tools()
    plain = TEMPLATE[TEMPLATE.index("{%- for m"):]
    assert not ChatRenderer(make_tokenizer(), plain, [add], 2).renders_tools()


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


def command(tmp_path, **overrides) -> list[str]:
    """python -m easylm.train --objective=grpo --grpo.tools=...: 2 steps of 8 prompts x 2
    episodes of up to 3 turns of <= 6 tokens, the tests' tokenizer saved under tmp_path."""
    tokenizer_dir = tmp_path / "tokenizer"
    make_tokenizer().save_pretrained(tokenizer_dir)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the cat", "a dog"] * 8))
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
             "logger.experiment_id": "run", **overrides}
    return ["train", *(f"--{k}={v}" for k, v in flags.items())]


def test_train_command_runs_on_through_failing_tools(tools_module, tmp_path, monkeypatch):
    """python -m easylm.train --objective=grpo --grpo.tools=...: tools that raise, hang past
    --grpo.tool_timeout, and calls with bad JSON each come back as a tool message, and the
    run trains its steps on."""
    from test_checkpoint import metrics

    from easylm import train

    seen = []
    step = environments.ToolEnvironment.step

    def recorded(self, messages):
        out = step(self, messages)
        seen.extend(m["content"] for m in out[0])
        return out

    monkeypatch.setattr(environments.ToolEnvironment, "step", recorded)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    train.main(command(tmp_path))
    got = metrics(tmp_path)
    assert sorted(got) == [1, 2]
    for key in ("data/rollout/turns_per_episode", "data/rollout/prefill_tokens_per_episode",
                "data/rollout/tool_calls", "data/rollout/tool_errors"):
        assert isinstance(got[2][key], float), key
    for expected in ("error: boom raised", "error: the call to hang timed out",
                     "error: the tool call is not valid JSON"):
        assert any(c.startswith(expected) for c in seen), (expected, seen)


# ------------------------------------------------------------ as users run it


def test_the_command_with_tools_in_bf16_with_lora_scanned_layers_and_a_sharded_mesh(
        tools_module, tmp_path):
    """The same command in bf16 (compute and parameters), with LoRA adapters, scanned
    layers and a dp x fsdp x mp mesh of the 8 devices, in one run: two steps (the second's
    rollouts read the adapters the first updated), episodes of several turns, and every
    step trains on exactly the tokens its rollouts sampled."""
    from test_checkpoint import metrics

    from easylm import train

    train.main(command(tmp_path, **{"dtype": "bf16", "param_dtype": "bf16", "lora.rank": 4,
                                    "llama.scan_layers": True, "mesh_dim": "2,2,2"}))
    got = metrics(tmp_path)
    assert sorted(got) == [1, 2]
    for step, line in got.items():
        assert np.isfinite(line["loss"]), (step, line)
        assert line["loss_tokens"] == line["completions/mean_length"] * 8 * 2, (step, line)
        assert line["data/rollout/turns_per_episode"] > 1, (step, line)
    assert got[2]["gradient_norm"] > 0


def test_a_tokenizer_that_adds_bos_gives_a_row_with_one():
    """The embedded tokenizer adds a BOS to what it encodes, and its chat template writes
    bos_token too: the prompt and each tool message's delta are the template's text
    without the tokenizer's own special tokens, so a conversation's row (a turn ended by
    its EOS, one cut before it, each followed by a tool's answer) is id for id what
    transformers' apply_chat_template(tokenize=True) makes of the whole conversation: one
    BOS, first. Negative twin: a renderer that lets the tokenizer add its BOS doubles it."""
    from easylm.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("embedded")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert tokenizer("x")["input_ids"][0] == bos and "bos_token" in tokenizer.chat_template

    def row_of(renderer):
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        row = renderer.ids(messages, True)
        for text, ended in (("I will add them.", True), ("The sum", False)):
            row += tokenizer(text, add_special_tokens=False)["input_ids"] + [eos] * ended
            messages.append({"role": "assistant", "content": text})
            new = [{"role": "tool", "content": "5"}]
            row += renderer.delta(messages, new, ended)
            messages += new
        return row, messages

    renderer = ChatRenderer(tokenizer, tokenizer.chat_template, None, eos)
    row, messages = row_of(renderer)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    assert row == expected and row.count(bos) == 1

    class Doubling(ChatRenderer):
        def ids(self, messages, generation):
            return list(self.tokenizer(self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False,
                add_generation_prompt=generation))["input_ids"])

    doubled, _ = row_of(Doubling(tokenizer, renderer.template, None, eos))
    assert doubled[:2] == [bos, bos] and doubled != expected


def test_a_bos_that_is_the_eos_is_not_taken_for_the_end_of_the_models_turn():
    """A tokenizer whose BOS is its EOS (GPT-2's <|endoftext|> is both), under a template
    that writes bos_token first and ends no turn with it: a tool message's delta is the
    template's new suffix alone, after a turn that drew the EOS or was cut before it (what
    the template writes after the model's turn is looked for in that turn only). Old
    code took the BOS for the turn's end and appended the whole history again."""
    tokenizer = make_tokenizer()
    tokenizer.bos_token = tokenizer.eos_token
    template = ("{{ bos_token }}{%- for m in messages %}<|im_start|>{{ m['role'] }} "
                "{{ m['content'] }} {% endfor %}{%- if add_generation_prompt %}<|im_start|>"
                "assistant {% endif %}")
    renderer = ChatRenderer(tokenizer, template, None, 2)
    chat = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "cat"}]
    new = [{"role": "user", "content": "5"}]
    before, after = renderer.ids(chat, False), renderer.ids(chat + new, True)
    assert before[0] == 2 and before.count(2) == 1
    for ended_by_eos in (True, False):
        assert renderer.delta(chat, new, ended_by_eos) == after[len(before):]
    # The Hermes template writes the EOS after the turn: a cut turn gets it as context.
    hermes = ChatRenderer(tokenizer, TEMPLATE, None, 2)
    assert hermes.delta(chat, new, False)[0] == 2 and hermes.delta(chat, new, True)[0] != 2


def test_tool_results_of_any_kind_are_text_the_model_reads(capsys):
    """Non-strings are JSON, or their str() where JSON has no form for them (a cycle, a
    set); a result with no text at all, and a tool raising what is not an Exception
    (KeyboardInterrupt, SystemExit), are errors the model reads; a tool's prints go to the
    trainer's stdout. (Exceptions, timeouts and bad JSON: the rollouts above.)"""
    cycle = []
    cycle.append(cycle)

    class NoText:
        def __str__(self):
            raise ValueError("no")

    def tool(value):
        def f():
            if isinstance(value, type) and issubclass(value, BaseException):
                raise value("stop")
            print("tool says hi")
            return value
        return f

    got = {repr(v): environments.call_with_timeout(tool(v), {}, 5.0) for v in (
        {"a": [1, None]}, None, (1, "x"), cycle, {3}, NoText(), KeyboardInterrupt, SystemExit)}
    assert list(got.values())[:5] == ['{"a": [1, null]}', "null", '[1, "x"]', "[[...]]", "{3}"]
    assert list(got.values())[5:] == ["error: f returned a NoText with no text (ValueError: no)",
                                      "error: f raised KeyboardInterrupt: stop",
                                      "error: f raised SystemExit: stop"]
    assert capsys.readouterr().out.count("tool says hi\n") == 6


def test_a_huge_tool_answer_is_cut_to_leave_the_model_its_turn(rollouts, tools_module):
    """A tool answering 1 MB of text: its message is cut (marked with its length) to what
    the row has room for, leaving the model a turn (max_new_tokens, or half the room
    left), and the episode goes on; rows stay within seq_length. A delta that fits is
    appended as it is; one that leaves no room even cut to nothing ends the episode."""
    _, _, tokenizer, renderer, _, engine = rollouts
    chat = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "cat"}]
    short = [{"role": "tool", "content": "5"}]
    assert renderer.fit(chat, short, True, S, 6) == (short, renderer.delta(chat, short, True))
    assert renderer.fit(chat, short, True, 3, 1) is None
    huge = [{"role": "tool", "content": "5 " * 500_000}]
    new, delta = renderer.fit(chat, huge, True, 40, 6)
    assert new[0]["content"].endswith(" [cut: 1000000 characters in all]")
    assert len(delta) == 40 - 6  # the most that leaves the model 6 tokens: "5 " is a token

    def add(a: int, b: int) -> str:
        return "5 " * 500_000

    eps = roll(engine, renderer, tokenizer, [add, tools_module[1].boom, tools_module[1].hang],
               True)
    cut = [(e, i) for e in eps for i, m in enumerate(e.messages)
           if m["content"].endswith("[cut: 1000000 characters in all]")]
    assert cut, "no episode called add: nothing to test"
    for e, i in cut:  # the model took its turn after the cut answer
        assert len(e.tokens) <= S and e.messages[i + 1]["role"] == "assistant"


def test_plan_preview_bench_and_doctor_given_tools(tools_module, tmp_path, capsys):
    """The other commands given the run's --grpo.tools: plan's memory is that of the same run
    without them (the rollouts' cache is the same rows); preview shows a prompt as its
    first episode starts, rendered with the tools' schemas; bench train, which times the
    next-token step only, says so in one line; doctor imports the tools (a problem line
    when it cannot: tests/test_doctor.py)."""
    from cli_utils import one_line_error

    from easylm import bench, doctor, flags, plan
    from easylm.data import preview
    from easylm.llama import train
    from easylm.llama.family import FAMILY

    argv = ["--objective=grpo", "--llama.base_model=debug", f"--llama.vocab_size={VOCAB}",
            "--train_dataset.json_dataset.path=prompts.jsonl", "--grpo.num_generations=2",
            "--train_dataset.json_dataset.seq_length=64", "--grpo.max_new_tokens=6"]
    tools = "--grpo.tools=grpo_test_tools:add,boom,hang"
    plans = [plan.estimate(flags.parse(plan.default_config(FAMILY),
                                       {**train.help_entries(), **plan.HELP}, ["plan", *a]),
                           FAMILY, num_devices=1) for a in (argv, [*argv, tools])]
    assert plans[0].rollout_cache > 0 and plans[1].rows() == plans[0].rows()

    make_tokenizer().save_pretrained(tmp_path / "tokenizer")
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "the cat", "answer": "5"}) + "\n")
    preview.main(["preview", f"--tokenizer={tmp_path / 'tokenizer'}",
                  f"--train_dataset.json_dataset.path={data}", "--num_examples=1",
                  "--train_dataset.json_dataset.seq_length=64", "--completion_tokens=6",
                  "--train_dataset.json_dataset.batch_size=1", "--num_batches=1", tools])
    lines = capsys.readouterr().out.splitlines()
    module = tools_module[1]
    schemas = [get_json_schema(f) for f in (module.add, module.boom, module.hang)]
    sampled = ChatRenderer(make_tokenizer(), TEMPLATE, schemas, 2).ids(
        [{"role": "user", "content": "the cat"}], True)
    assert lines[:3] == [
        "--- prompt 0",
        ("<|im_start|> system <tools> add boom hang </tools> <|im_end|> <|im_start|> user "
         "the cat <|im_end|> <|im_start|> assistant"),
        f"({len(sampled)} tokens; to the rewards: {{'answer': '5'}})"]
    assert lines[1] == make_tokenizer().decode(sampled)
    assert lines[-1] == ("episode prompts that leave no room in the row (the rollout stops "
                         "with an error there): 0")
    assert one_line_error(preview.main, ["preview", tools], capsys).startswith(
        "--grpo.tools and --grpo.environment preview GRPO's prompts: give --completion_tokens")

    assert one_line_error(bench.main, ["bench", "train", "--objective=grpo", tools],
                          capsys).startswith("--objective=grpo: bench train times the "
                                             "next-token step on synthetic tokens")
    with pytest.raises(SystemExit) as e:
        doctor.main(["doctor", *argv, tools, f"--logger.output_dir={tmp_path}"])
    assert e.value.code == 0 and "no problems found" in capsys.readouterr().out


@pytest.mark.extended  # a second engine's programs and 8 episodes (~40 s); CI's cover of
# `extend` on pages: test_serving_pages' shared prompts (`prefill_after`)
def test_episodes_on_pages_reuse_their_pages_and_sample_what_the_dense_cache_does(
        rollouts, tools_module):
    """--grpo.page_size: a later turn's `extend` writes onto the pages the episode's slot
    holds (no page returned, the history not run again), so the episodes sample the dense
    engine's tokens with its log-probabilities (to fp32 rounding, as
    test_serving_pages.test_pages_serve_what_the_dense_cache_serves), and hold at most
    S / 8 pages each; the prompts' tokens only are prefilled either way."""
    _, params, tokenizer, renderer, out, engine = rollouts
    paged = engine_lib.Engine({**ENGINE, "page_size": 8}, engine.model, params)
    module = tools_module[1]
    functions = [module.add, module.boom, module.hang]
    eps = roll(paged, renderer, tokenizer, functions, True)
    assert [e.tokens for e in eps] == [e.tokens for e in out[True]]
    for e, dense in zip(eps, out[True]):
        np.testing.assert_allclose(e.logprobs, dense.logprobs, atol=1e-5, rtol=0)
    assert [e.prefilled for e in eps] == [e.prefilled for e in out[True]]
    assert 0 < paged.pages.in_use <= 8 * S // 8
