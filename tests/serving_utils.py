"""Shared pieces of the serving tests: a tiny tokenizer and a tiny model behind a batcher."""

import functools
import socket
import threading
import time

import jax
import numpy as np
import pytest
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.llama.model import LLaMAForCausalLM
from easylm.runtime.sharding import init_sharded
from easylm.serving import engine as engine_lib, programs
from easylm.serving.batcher import Batcher, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
SHORT = SamplingParams(max_tokens=8, temperature=0.0)
PROMPTS = [[1, 5, 9, 33], [1, 7], [1] + list(range(40, 63)), [1, 3, 3, 3, 3], [1, 99, 100]]


@pytest.fixture(scope="module")
def tokenizer():
    """The tests' tokenizer (`make_tokenizer()`); import it into a test module to use it."""
    return make_tokenizer()


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Serving language models means batching requests that arrive at any time.",
    "Continuous batching lets a new request join while others are decoding.",
    "Héllo wörld, ünïcödé and emoji 🙂 exercise multi-byte characters.",
] * 20


def make_tokenizer(vocab_size: int = 320, adds_bos: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with <pad>, </s> and a chat template. `adds_bos`: like
    LLaMA's, `tokenizer(text)` puts BOS <s> first; else like SmolLM2's, its BOS is
    <|im_start|> but `tokenizer(text)` adds nothing. The same vocabulary either way."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(["<|im_start|>"])  # id vocab_size, after the trained vocabulary
    bos = "<s>" if adds_bos else "<|im_start|>"
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(**overrides) -> LLaMAConfig:
    # A larger init than training's makes the next-token distribution peaked, so
    # greedy choices are far from ties and comparisons are meaningful.
    return LLaMAConfig.from_preset("debug", initializer_range=0.2, **overrides)


@functools.lru_cache
def _forward(model):
    return jax.jit(lambda params, ids: jax.nn.log_softmax(model.apply({"params": params}, ids)))


def log_softmax(model, params, ids, length=64):
    """Log-probabilities (len(ids), V) from a full forward, no cache (padded to one jit shape:
    causal attention makes the padding invisible to the real positions)."""
    padded = np.zeros((1, length), np.int32)
    padded[0, :len(ids)] = ids
    return np.asarray(_forward(model)(params, padded))[0, :len(ids)]


def full_forward_greedy(model, params, prompt, steps):
    """Reference: re-run the whole sequence for every new token, no cache."""
    ids, logprobs = list(prompt), []
    for _ in range(steps):
        logp = log_softmax(model, params, ids)[-1]
        ids.append(int(np.argmax(logp)))
        logprobs.append(float(logp[ids[-1]]))
    return ids[len(prompt):], logprobs


def make_batcher(config=None, mesh=None, stop_token_ids=(), params=None, **engine_config):
    """(a started Batcher, the module, its parameters): `params`, or random ones."""
    config = config or tiny_config()
    fns, model = FAMILY.bind(config), LLaMAForCausalLM(config)
    if params is not None:
        pass
    elif mesh is None:
        params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    else:
        params = init_sharded(model.init_params, fns.partition_rules, mesh, jax.random.PRNGKey(0))
    engine = engine_lib.Engine(
        engine_lib.get_default_config({"batch_size": 4, "seq_length": 64, "decode_steps": 4,
                                       **engine_config}),
        fns, params, mesh)
    return Batcher(engine, stop_token_ids).start(), model, params


class ServerThread:
    """uvicorn serving `app` on a free 127.0.0.1 port from a thread, for the tests' lifetime;
    `settings`: uvicorn.Config's (`easylm.serving.limits.uvicorn_settings`)."""

    def __init__(self, app, **settings):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **settings))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        for _ in range(600):
            if self.server.started:
                return self
            time.sleep(0.05)
        raise RuntimeError("uvicorn did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


def assert_engine_greedy_equals_generate(model, bound, params):
    """12 greedy tokens from the serving engine (chunked prefill, then decode over the
    cache) = transformers' `model.generate`, prompts of 13 tokens (two prefill chunks) and
    5, one after the other in the same slot. `bound`: the family bound to its config."""
    import torch

    engine = engine_lib.Engine({"batch_size": 2, "seq_length": 32, "min_bucket": 16,
                                "decode_steps": 4, "prefill_chunk_size": 8}, bound, params)
    for prompt in ([5, 77, 300, 12, 9, 450, 31, 8, 200, 64, 3, 99, 17], [41, 7, 260, 88, 5]):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=12,
                                      do_sample=False)[0, len(prompt):].tolist()
        out = engine.fetch(engine.prefill([prompt], [0], engine_lib.Sampling.empty(1)))
        tokens = [int(out[0][0, 0])]
        for _ in range(3):
            step = engine.fetch(engine.decode(engine_lib.Sampling.empty(2)))
            tokens += [int(t) for t in step[0][:, 0]]
        assert tokens[:12] == expected, prompt


def prefill_program_bytes(model, seq_length: int, chunk: int) -> int:
    """What XLA's analysis says the engine's prefill program of one `seq_length`-token
    prompt (one slot, chunks of `chunk`) holds: arguments + outputs - aliased +
    temporaries, the figure the serving plan (`--plan.serve_tokens`) is checked against."""
    params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
    engine = engine_lib.Engine({"batch_size": 1, "seq_length": seq_length,
                                "min_bucket": seq_length, "prefill_chunk_size": chunk},
                               model, params)
    rows = programs.PromptRows(np.zeros((1, seq_length), np.int32),
                                 np.full(1, seq_length, np.int32), np.zeros(1, np.int32),
                                 np.zeros(1, np.int32))  # every prefill gathers its rows
    args = (engine.weights, engine.state, rows, engine_lib.Sampling.empty(1))
    m = engine._prefill_fns[False].lower(*args).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)
