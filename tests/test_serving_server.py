"""The HTTP server: OpenAI client, EasyLM fields, lm-eval's scoring call, concurrency,
disconnects, bad input. One tiny model served by uvicorn on 127.0.0.1 for the module."""

import json
import os
import shlex
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from numerics import logprob_atol_for
from serving_utils import ServerThread, log_softmax, make_batcher, make_tokenizer

from easylm import flags as flag_lib
from easylm.errors import UserError
from easylm.llama.family import FAMILY
from easylm.serving import cli as serving_cli, scoring, server as server_lib, service as service_lib
from easylm.serving.engine import bucket_for

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def live(tokenizer):
    """(base url, Service, model, params) of a running server."""
    batcher, model, params = make_batcher(stop_token_ids=(tokenizer.eos_token_id,))
    service = server_lib.Service({"api_key": KEY, "max_tokens": 32, "max_request_bytes": 65536,
                                  "max_prompts": 8}, batcher, tokenizer)
    with ServerThread(server_lib.create_app(service)) as server:
        yield server.url, service, model, params
    batcher.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live[0] + "/v1", api_key=KEY, max_retries=0)


def post(live, path, body, headers=AUTH):
    return httpx.post(live[0] + path, json=body, headers=headers, timeout=120)


def test_openai_client_completions_chat_and_streaming(client):
    assert [m.id for m in client.models.list().data] == ["easylm"]
    done = client.completions.create(model="easylm", prompt="The quick brown", max_tokens=12,
                                     temperature=0)
    streamed = client.completions.create(model="easylm", prompt="The quick brown", max_tokens=12,
                                         temperature=0, stream=True)
    pieces = [chunk.choices[0].text for chunk in streamed]
    assert len(pieces) > 1 and "".join(pieces) == done.choices[0].text
    assert done.usage.completion_tokens <= 12

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model="easylm", messages=messages, max_tokens=10,
                                          temperature=0, logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    stream = client.chat.completions.create(model="easylm", messages=messages, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_several_prompts_and_seeded_sampling(client):
    prompts = ["The quick", "Serving language models"]
    out = client.completions.create(model="easylm", prompt=prompts, max_tokens=6,
                                    temperature=0.9, seed=3)
    again = client.completions.create(model="easylm", prompt=prompts, max_tokens=6,
                                      temperature=0.9, seed=3)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [c.text for c in again.choices]


def streamed_texts(stream) -> dict[int, str]:
    """Each choice's text from an OpenAI client stream (completions or chat), by index."""
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else c.delta.content
            texts[c.index] = texts.get(c.index, "") + (piece or "")
    return texts


def test_n_samples_are_the_single_requests_with_derived_seeds(client, tokenizer):
    """Choice p * n + i of a request for n samples is prompt p with n=1 and seed
    `sample_seed(seed, i)` = seed + i, streamed or not."""
    prompts, seed = ["The quick", "Serving language models"], 3
    args = dict(model="easylm", max_tokens=8, temperature=1.0)
    out = client.completions.create(prompt=prompts, n=4, seed=seed, **args)
    assert [c.index for c in out.choices] == list(range(8))
    alone = [client.completions.create(prompt=prompts[p], seed=seed + i, **args)
             for p in range(2) for i in range(4)]
    single = [a.choices[0].text for a in alone]
    assert [c.text for c in out.choices] == single
    assert len(set(single[:4])) > 1  # the samples of one prompt are not one sample
    streamed = client.completions.create(prompt=prompts, n=4, seed=seed, stream=True, **args)
    assert streamed_texts(streamed) == dict(enumerate(single))
    # OpenAI's usage: each prompt counted once, every sample's tokens.
    assert out.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert out.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    messages = [{"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(messages=messages, n=4, seed=seed, **args)
    single = [client.chat.completions.create(messages=messages, seed=seed + i, **args)
              for i in range(4)]
    assert [c.index for c in chat.choices] == list(range(4))
    assert [c.message.content for c in chat.choices] == [s.choices[0].message.content
                                                         for s in single]
    assert chat.usage.prompt_tokens == single[0].usage.prompt_tokens
    assert chat.usage.completion_tokens == sum(s.usage.completion_tokens for s in single)
    streamed = client.chat.completions.create(messages=messages, n=4, seed=seed, stream=True,
                                              stream_options={"include_usage": True}, **args)
    chunks = list(streamed)
    assert streamed_texts(chunks) == {i: c.message.content for i, c in enumerate(chat.choices)}
    assert chunks[-1].usage.model_dump() == chat.usage.model_dump()


def test_n_samples_without_a_seed_differ_and_greedy_ones_agree(client):
    args = dict(model="easylm", prompt="The quick", max_tokens=12, n=4)
    sampled = client.completions.create(temperature=1.0, **args)
    assert len({c.text for c in sampled.choices}) > 1
    greedy = client.completions.create(temperature=0, **args)
    assert len({c.text for c in greedy.choices}) == 1


def test_sample_seeds_wrap_within_int64(client):
    """seed + i past int64's top wraps to its bottom, a seed a request may send."""
    top = 2**63 - 1
    assert service_lib.sample_seed(top, 1) == -2**63
    assert service_lib.sample_seed(None, 3) is None
    args = dict(model="easylm", prompt="The quick", max_tokens=8, temperature=1.0)
    two = client.completions.create(n=2, seed=top, **args)
    alone = client.completions.create(seed=-2**63, **args)
    assert two.choices[1].text == alone.choices[0].text


def lm_eval_loglikelihood(response, ctxlen):
    """lm-evaluation-harness's parse_logprobs for local-completions, restated."""
    choice = response["choices"][0]["logprobs"]
    logprobs = choice["token_logprobs"][ctxlen:-1]
    tops = choice["top_logprobs"][ctxlen:-1]
    return sum(logprobs), all(lp == max(top.values()) for lp, top in zip(logprobs, tops))


def test_echo_logprobs_score_like_lm_eval_expects(live, tokenizer):
    _, service, model, params = live
    atol = logprob_atol_for(model, params)  # each number from another program
    context = tokenizer("The quick brown")["input_ids"]  # BOS first (this tokenizer adds it)
    continuation = tokenizer(" fox jumps", add_special_tokens=False)["input_ids"]
    body = {"model": "easylm", "prompt": [context + continuation], "echo": True, "logprobs": 1,
            "temperature": 0, "seed": 1234}
    scored = post(live, "/v1/completions", {**body, "max_tokens": 1}).json()
    ll, is_greedy = lm_eval_loglikelihood(scored, len(context))
    # The same numbers from EasyLM's endpoint and from a plain forward pass.
    easylm = post(live, "/loglikelihood", {"prefix_text": ["The quick brown"],
                                           "text": [" fox jumps"]}).json()
    terms = len(continuation)
    assert ll == pytest.approx(easylm["log_likelihood"][0], abs=atol(terms))
    assert is_greedy == easylm["is_greedy"][0]
    tokens = context + continuation
    logp = log_softmax(model, params, tokens[:-1])
    expected = sum(logp[i - 1, tokens[i]] for i in range(len(context), len(tokens)))
    assert ll == pytest.approx(float(expected), abs=atol(terms))
    # max_tokens=0: the prompt's log-probabilities only, no generated token.
    only_prompt = post(live, "/v1/completions", {**body, "max_tokens": 0}).json()
    lp = only_prompt["choices"][0]["logprobs"]["token_logprobs"]
    assert lp[0] is None and len(lp) == len(tokens)
    assert sum(lp[len(context):]) == pytest.approx(ll, abs=atol(terms))


def test_easylm_endpoints_return_easylm_fields(live):
    ll = post(live, "/loglikelihood", {"prefix_text": ["a", "b"], "text": [" c", " d"]}).json()
    assert set(ll) == {"prefix_text", "text", "log_likelihood", "is_greedy"}
    assert len(ll["log_likelihood"]) == 2 and all(x < 0 for x in ll["log_likelihood"])
    rolling = post(live, "/loglikelihood-rolling", {"text": ["The quick brown fox. " * 30]}).json()
    assert set(rolling) == {"text", "log_likelihood", "is_greedy"}
    assert rolling["log_likelihood"][0] < 0
    generated = post(live, "/generate", {"prefix_text": ["The", "A"], "temperature": 0}).json()
    assert set(generated) == {"prefix_text", "output_text", "temperature"}
    assert len(generated["output_text"]) == 2
    until = post(live, "/greedy-until", {"prefix_text": ["The"], "until": [["\n", "."]]}).json()
    assert set(until) == {"prefix_text", "until", "max_length", "output_text"}
    assert until["output_text"][0] == generated["output_text"][0].split("\n")[0].split(".")[0]
    chat = post(live, "/chat", {"prompt": "Hello", "context": "", "temperature": 0}).json()
    assert set(chat) == {"response", "context", "temperature"}
    assert chat["context"] == "User: Hello\nAssistant: " + chat["response"] + "\n"


BAD_INPUTS = [
    # (what, path, raw body or JSON, headers, status, message fragment)
    ("malformed JSON", "/v1/completions", b'{"prompt": "x",', AUTH, 400, "malformed JSON body"),
    ("prompt of the wrong type", "/v1/completions", {"prompt": 5}, AUTH, 400,
     "prompt: must be a string"),
    ("max_tokens not an int", "/v1/completions", {"prompt": "x", "max_tokens": "9"}, AUTH, 400,
     "max_tokens: Input should be a valid integer"),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, AUTH, 400,
     "messages: Input should be a valid list"),
    ("unknown chat role", "/v1/chat/completions",
     {"messages": [{"role": "robot", "content": "x"}]}, AUTH, 400, "messages.0.role"),
    ("prompt longer than the context", "/v1/completions", {"prompt": "The quick brown fox " * 30},
     AUTH, 400, "the context is 64 tokens"),
    ("prompt + max_tokens over the context", "/v1/completions",
     {"prompt": "The quick brown fox " * 3, "max_tokens": 32}, AUTH, 400,
     "together more than the context of 64 tokens"),
    ("max_tokens 0 without echo", "/v1/completions", {"prompt": "x", "max_tokens": 0}, AUTH, 400,
     "max_tokens must be >= 1"),
    ("max_tokens negative", "/v1/completions", {"prompt": "x", "max_tokens": -3}, AUTH, 400,
     "max_tokens must be >= 1"),
    ("max_tokens above the limit", "/v1/completions", {"prompt": "x", "max_tokens": 33}, AUTH,
     400, "max_tokens=33 is above this server's limit of 32"),
    ("chat max_tokens 0", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, AUTH, 400,
     "max_tokens must be >= 1"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -0.5}, AUTH, 400,
     "temperature: Input should be greater than or equal to 0"),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, AUTH, 404,
     "model 'gpt-4' does not exist"),
    ("n zero", "/v1/completions", {"prompt": "x", "n": 0}, AUTH, 400,
     "n=0 is outside this server's range of 1 to 4 (its batch slots, --batch_size)"),
    ("n negative", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "n": -1}, AUTH, 400,
     "n=-1 is outside this server's range of 1 to 4"),
    ("n above the batch slots", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "n": 5}, AUTH, 400,
     "n=5 is outside this server's range of 1 to 4 (its batch slots, --batch_size)"),
    ("prompts x n above --max_prompts", "/v1/completions", {"prompt": ["a"] * 3, "n": 3}, AUTH,
     400, "n=3 samples of 3 prompts are 9 sequences, above this server's limit of 8 per "
          "request (--max_prompts)"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 99999]}, AUTH, 400,
     "prompt token ids must be in [0, 512)"),
    ("missing API key", "/v1/completions", {"prompt": "x"}, {}, 401, "missing or wrong API key"),
    ("wrong API key", "/v1/models", None, {"Authorization": "Bearer nope"}, 401,
     "missing or wrong API key"),
    ("body above the size limit", "/v1/completions", {"prompt": "x" * 70000}, AUTH, 413,
     "above the limit of 65536 bytes"),
    # Numbers the device cannot hold: they once failed every request in flight with a 500.
    ("top_k above the vocabulary", "/v1/completions",
     {"prompt": "x", "max_tokens": 2, "top_k": 2147483648}, AUTH, 400,
     "top_k=2147483648 is above the vocabulary size of 512"),
    ("top_p that float32 flushes to 0", "/v1/completions", {"prompt": "x", "top_p": 1e-39},
     AUTH, 400, "top_p: must be at least 1.18e-38"),
    ("seed beyond 64 bits", "/v1/completions", {"prompt": "x", "seed": 2**64}, AUTH, 400,
     "seed: Input should be less than 9223372036854775808"),
    ("NaN temperature", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', AUTH, 400,
     "temperature: Input should be a finite number"),
    ("more prompts than --max_prompts", "/v1/completions", {"prompt": ["a"] * 9}, AUTH, 400,
     "prompt has 9 entries, above this server's limit of 8 per request (--max_prompts)"),
    ("more EasyLM texts than --max_prompts", "/loglikelihood-rolling", {"text": ["a"] * 9},
     AUTH, 400, "text has 9 entries"),
    # Text that is not text, bodies that are not JSON: a JSON 400 naming the problem.
    ("lone surrogate in a prompt", "/v1/completions", b'{"prompt": "ab\\ud800"}', AUTH, 400,
     "prompt: entry 0 is not valid Unicode: a lone surrogate '\\ud800' at index 2"),
    ("lone surrogate in chat content", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\ud800"}]}', AUTH, 400,
     "messages.0.content: is not valid Unicode"),
    ("lone surrogate in an EasyLM text", "/loglikelihood", b'{"text": ["ok", "\\udfff"]}', AUTH,
     400, "text.1: is not valid Unicode"),
    ("body not UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', AUTH, 400,
     "malformed JSON body: not UTF-8 (byte 0xff at position 12)"),
    ("JSON nested 5000 deep", "/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     AUTH, 400, "malformed JSON body: nested too deeply"),
    ("EasyLM lists of different lengths", "/loglikelihood",
     {"prefix_text": ["a"], "text": ["b", "c"]}, AUTH, 400, "prefix_text has 1 entries"),
    ("EasyLM unknown field", "/generate", {"prefix_text": ["a"], "temprature": 0}, AUTH, 400,
     "temprature: Extra inputs are not permitted"),
    ("unknown path", "/v2/nothing", {}, AUTH, 404, "Not Found"),
]


@pytest.mark.parametrize("adds_bos", [True, False], ids=["llama-style", "smollm-style"])
def test_text_prompts_are_tokenized_as_the_tokenizer_does(live, adds_bos):
    """A text prompt reads as `tokenizer(text)`: BOS first only where the tokenizer puts it
    (SmolLM2's has a bos_token it never adds). EasyLM's scoring reads [BOS] + prefix + text
    only then, else prefix + text."""
    _, service, model, params = live
    tokenizer = make_tokenizer(adds_bos=adds_bos)
    ids = tokenizer("The quick brown")["input_ids"]
    plain = tokenizer("The quick brown", add_special_tokens=False)["input_ids"]
    assert ids == ([tokenizer.bos_token_id] if adds_bos else []) + plain
    app = server_lib.create_app(server_lib.Service({"max_tokens": 32}, service.batcher, tokenizer))
    http = TestClient(app, base_url="http://127.0.0.1")

    def completion(prompt, **fields):
        return http.post("/v1/completions", json={"prompt": prompt, "temperature": 0,
                                                  **fields}).json()

    echoed = completion("The quick brown", echo=True, logprobs=1, max_tokens=0)
    assert echoed["usage"]["prompt_tokens"] == len(ids)
    assert echoed["choices"][0]["logprobs"] == completion(ids, echo=True, logprobs=1,
                                                          max_tokens=0)["choices"][0]["logprobs"]
    assert (completion("The quick brown", max_tokens=8)["choices"][0]["text"]
            == completion(ids, max_tokens=8)["choices"][0]["text"])

    text = tokenizer(" fox jumps", add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id]
    scored = http.post("/loglikelihood", json={"prefix_text": ["The quick brown", ""],
                                               "text": [" fox jumps"] * 2}).json()

    def reference(context):
        logp = log_softmax(model, params, context + text[:-1])
        return float(sum(logp[len(context) - 1 + i, t] for i, t in enumerate(text)))

    with_prefix = reference((bos if adds_bos else []) + plain)
    assert scored["log_likelihood"][0] == pytest.approx(with_prefix, abs=1e-4)
    # The other tokenization gives another number: the check can fail.
    assert abs(reference((bos if not adds_bos else []) + plain) - with_prefix) > 1e-2
    # An empty prefix: the text's first token is read after BOS, either way.
    assert scored["log_likelihood"][1] == pytest.approx(reference(bos), abs=1e-4)


def test_add_bos_token_overrides_the_tokenizer(live):
    _, service, _, _ = live
    batcher = service.batcher
    for adds_bos in (True, False):
        tokenizer = make_tokenizer(adds_bos=adds_bos)
        plain = tokenizer("The quick", add_special_tokens=False)["input_ids"]
        forced = server_lib.Service({"add_bos_token": "true"}, batcher, tokenizer)
        assert forced.encode("The quick") == [tokenizer.bos_token_id] + plain
        assert forced.prompts_start_with_bos
        never = server_lib.Service({"add_bos_token": "false"}, batcher, tokenizer)
        assert never.encode("The quick") == plain and not never.prompts_start_with_bos
        # A chat template's text (this one writes its own bos_token) gets no second BOS.
        assert forced.apply_chat_template([{"role": "user", "content": "hi"}]).count(
            tokenizer.bos_token_id) == 1
    with pytest.raises(UserError, match="--add_bos_token must be auto, true or false, got 'yes'"):
        server_lib.Service({"add_bos_token": "yes"}, batcher, make_tokenizer())


@pytest.mark.parametrize("what,path,body,headers,status,message", BAD_INPUTS,
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_a_4xx_json_error(live, what, path, body, headers, status, message):
    if body is None:
        response = httpx.get(live[0] + path, headers=headers)
    elif isinstance(body, bytes):
        response = httpx.post(live[0] + path, content=body,
                              headers={**headers, "Content-Type": "application/json"})
    else:
        response = post(live, path, body, headers)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"]
    # ... and the server keeps serving.
    assert httpx.get(live[0] + "/health", headers=AUTH).json()["status"] == "ok"


def test_only_the_chat_page_is_open_without_the_key(live):
    page = httpx.get(live[0] + "/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text
    for path in ("/health", "/ready", "/v1/models"):
        assert httpx.get(live[0] + path).status_code == 401
        assert httpx.get(live[0] + path, headers=AUTH).status_code == 200


def mixed_requests(client_index: int):
    """Three requests of different kinds and lengths for one client."""
    words = ["The quick brown fox", "Serving", "Continuous batching lets a new request join",
             "Héllo wörld", "a"]
    prompt = " ".join(words[(client_index + j) % len(words)] for j in range(1 + client_index % 3))
    return [
        ("/v1/completions", {"prompt": prompt, "max_tokens": 4 + client_index % 9,
                             "temperature": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                  "max_tokens": 3 + client_index % 5, "temperature": 0}),
        ("/generate", {"prefix_text": [prompt[: 1 + client_index]], "temperature": 0}),
    ]


def answer(response) -> str:
    body = response.json()
    if "output_text" in body:
        return body["output_text"][0]
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_32_concurrent_clients_get_what_they_get_alone(live):
    alone = {(i, j): answer(post(live, path, body))
             for i in range(32) for j, (path, body) in enumerate(mixed_requests(i))}

    def client(i):
        with httpx.Client(headers=AUTH, timeout=300) as http:
            out = {}
            for j, (path, body) in enumerate(mixed_requests(i)):
                response = http.post(live[0] + path, json=body)
                assert response.status_code == 200, response.text
                out[(i, j)] = answer(response)
            return out

    together = {}
    with ThreadPoolExecutor(32) as pool:
        for result in pool.map(client, range(32)):
            together.update(result)
    assert together == alone


class _Gate:
    """Holds the batcher's decode calls until released, so a request is surely in flight."""

    def __init__(self, engine):
        self.engine, self.decode, self.open = engine, engine.decode, threading.Event()

    def __enter__(self):
        def held(*args):
            self.open.wait(60)
            return self.decode(*args)

        self.engine.decode = held
        return self

    def __exit__(self, *exc):
        self.open.set()
        self.engine.decode = self.decode


def _wait_for(condition, what):
    for _ in range(400):  # bounded: 20 s at most
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_its_slot(live, stream):
    url, service, _, _ = live
    batcher = service.batcher
    submitted = []
    real_submit = batcher.submit
    batcher.submit = lambda g: (submitted.append(g), real_submit(g))[1]
    try:
        with _Gate(batcher.engine) as gate:
            body = json.dumps({"prompt": "The", "max_tokens": 30, "temperature": 0,
                               "stream": stream}).encode()
            raw = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                        b"application/json\r\nAuthorization: Bearer " + KEY.encode() +
                        b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            _wait_for(lambda: submitted and any(s is submitted[0] for s in batcher.slots),
                      "the request to take a slot")
            raw.close()
            _wait_for(lambda: submitted[0].cancelled, "the server to notice the disconnect")
            gate.open.set()
            _wait_for(lambda: all(s is None for s in batcher.slots), "the slot to be freed")
        assert submitted[0].finish_reason == "cancelled"
    finally:
        batcher.submit = real_submit


class _Trace:
    """Records the engine's device calls in order ('prefill', 'decode', 'score'), and holds
    the first scoring call until `release_first_score` is set."""

    def __init__(self, engine, release_first_score: threading.Event | None = None):
        self.engine, self.run, self.calls = engine, engine._run, []
        self.release = release_first_score
        self.names = {**{id(f): "prefill" for f in engine._prefill_fns.values()},
                      **{id(f): "decode" for f in engine._decode_fns.values()},
                      id(engine._score_fn): "score"}

    def __enter__(self):
        def traced(fn, *args):
            name = self.names[id(fn)]
            self.calls.append(name)
            if name == "score" and self.release is not None and self.calls.count("score") == 1:
                self.release.wait(60)
            return self.run(fn, *args)

        self.engine._run = traced
        return self

    def __exit__(self, *exc):
        if self.release is not None:
            self.release.set()
        self.engine._run = self.run


def test_scoring_interleaves_with_generation(live, tokenizer):
    """A 4-token request sent while a >= 100-window rolling job scores gets its answer
    within 3x the device calls it takes alone: the job runs a chunk per batcher turn."""
    url, service, _, _ = live
    batcher, engine = service.batcher, service.batcher.engine
    text = "The quick brown fox jumps over the lazy dog. " * 210
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # Every window fills the context; a score call takes as many as its length bucket's
    # prefill_budget holds: the job's chunks.
    windows = len(scoring.rolling_windows(ids, 1, 64))
    chunks = -(-windows // engine.prefill_rows[bucket_for(64, engine.length_buckets)])
    assert windows >= 100 and chunks >= 10
    body = {"prompt": "The quick", "max_tokens": 4, "temperature": 0}
    with _Trace(engine) as alone:
        expected = post(live, "/v1/completions", body).json()["choices"][0]["text"]

    submitted = threading.Event()
    real_submit = batcher.submit

    def submit(g):  # marks, on the batcher's thread, where in the calls the request ends
        emit = g.on_event
        g.on_event = lambda e: (e.finish_reason and trace.calls.append("finished"), emit(e))
        real_submit(g)
        submitted.set()

    batcher.submit = submit
    try:
        with _Trace(engine, release_first_score=submitted) as trace, ThreadPoolExecutor(2) as pool:
            rolling = pool.submit(post, live, "/loglikelihood-rolling", {"text": [text]})
            _wait_for(lambda: trace.calls, "the scoring job to start")
            answer = pool.submit(post, live, "/v1/completions", body).result()
            rolled = rolling.result().json()
    finally:
        batcher.submit = real_submit
    assert answer.json()["choices"][0]["text"] == expected
    until_finished = trace.calls[:trace.calls.index("finished")]
    assert len(until_finished) <= 3 * len(alone.calls), (alone.calls, trace.calls)
    assert until_finished.count("score") < chunks == trace.calls.count("score")
    # Scored in chunks, the job's answer is the one it gets in one piece.
    ((whole, greedy),) = batcher.run(scoring.loglikelihood_rolling, engine, service.bos_id,
                                     [ids]).result()
    assert rolled["log_likelihood"][0] == pytest.approx(whole, rel=1e-6)
    assert rolled["is_greedy"][0] == greedy


def test_a_scoring_job_stops_when_its_client_disconnects(live):
    url, service, _, _ = live
    batcher, engine = service.batcher, service.batcher.engine
    futures, real_score = [], batcher.score
    batcher.score = lambda *args: futures.append(real_score(*args)) or futures[-1]
    gone = threading.Event()
    body = json.dumps({"text": ["The quick brown fox. " * 200]}).encode()
    try:
        with _Trace(engine, release_first_score=gone) as trace:
            raw = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            raw.sendall(b"POST /loglikelihood-rolling HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Content-Type: application/json\r\nAuthorization: Bearer " +
                        KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                        b"\r\n\r\n" + body)
            _wait_for(lambda: trace.calls, "the first chunk")
            raw.close()
            _wait_for(lambda: futures[0].cancelled(), "the server to cancel the job")
            gone.set()
            _wait_for(lambda: not batcher._scoring, "the batcher to drop the job")
        assert trace.calls == ["score"]  # of 47 chunks, only the one under way ran
    finally:
        batcher.score = real_score


def test_a_stream_shows_its_first_token_right_after_prefill(live):
    url, service, _, _ = live
    body = {"prompt": "The quick", "max_tokens": 20, "temperature": 0, "logprobs": 1}
    expected = post(live, "/v1/completions", body).json()["choices"][0]
    with _Gate(service.batcher.engine) as gate:  # no decode call runs until the gate opens
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          headers=AUTH, timeout=30) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            first = json.loads(next(lines).removeprefix("data: "))
            assert not gate.open.is_set()
            assert len(first["choices"][0]["logprobs"]["tokens"]) == 1
            gate.open.set()
            rest = [json.loads(line.removeprefix("data: ")) for line in lines
                    if line != "data: [DONE]"]
    text = "".join(c["choices"][0]["text"] for c in [first] + rest)
    assert text == expected["text"]


def test_lm_eval_recipe_pre_compiles():
    """docs/serving.md's lm-eval command compiles every bucket before lm-eval's first request."""
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "serving.md")).read()
    recipe = docs[docs.index("## Evaluating with lm-evaluation-harness"):]
    command = next(line for line in recipe.splitlines() if "python -m easylm.llama.serve" in line)
    argv = [a for a in shlex.split(command.rstrip("&").replace("\\", "")) if a.startswith("--")]
    config = flag_lib.parse(serving_cli.default_config(FAMILY), serving_cli.help_entries(FAMILY), ["serve"] + argv)
    assert config.pre_compile


def test_usage_reports_prompt_tokens_served_from_a_shared_prompt(live, tokenizer):
    # Two prompts of one request admitted together (the batcher held until both wait):
    # the same prompt twice runs once, and the copy's tokens are OpenAI's
    # usage.prompt_tokens_details.cached_tokens; two different prompts have none.
    batcher = live[1].batcher
    text = "Serving language models means batching"
    for prompts, cached in (([text, text], len(tokenizer(text)["input_ids"])),
                            ([text, "The quick brown fox"], 0)):
        held = threading.Event()
        batcher.run(held.wait, 30)
        with ThreadPoolExecutor(1) as pool:
            response = pool.submit(post, live, "/v1/completions", {
                "model": "easylm", "prompt": prompts, "max_tokens": 2, "temperature": 0})
            _wait_for(lambda: len(batcher._waiting) == 2, "both prompts waiting")
            held.set()
            usage = response.result().json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": cached}


def test_64_requests_of_any_length_with_pages_for_a_quarter_all_get_their_answer_alone(
        live, tokenizer):
    # A hostile mix: 64 concurrent token-id prompts of random lengths up to the context
    # (64 positions), on a paged server of 32 slots whose pool holds the pages of a
    # quarter of them (8-position pages; a request holds its prompt's and max_tokens'),
    # so most wait for pages: each is queued, none fails, and each gets the greedy tokens
    # it gets alone from the dense server. Fairness, the bound the batcher keeps
    # (`_take_turns`, `_fit_pages`: first come, first served, a request's prompts taking
    # turns with other requests'): every request, one prompt each, is admitted in the
    # order it arrived, so none waits behind a later one however short.
    rs = np.random.RandomState(7)
    bodies = []
    for _ in range(64):
        length = int(rs.randint(1, 60))
        bodies.append({"prompt": [rs.randint(3, 300, length).tolist()], "temperature": 0,
                       "max_tokens": int(rs.randint(1, min(12, 64 - length) + 1))})
    needed = sum(-(-(len(b["prompt"][0]) + b["max_tokens"]) // 8) for b in bodies)
    batcher, _, _ = make_batcher(stop_token_ids=(tokenizer.eos_token_id,), params=live[3],
                                 batch_size=32, page_size=8, pages=needed // 4 + 1)
    arrived, admitted, cut = [], [], []
    notify, admit, fit = batcher._wake.notify, batcher._admit, batcher._fit_pages

    def arrive():  # under the batcher's lock, right after `submit` queued a request
        if batcher._waiting and id(batcher._waiting[-1]) not in map(id, arrived):
            arrived.append(batcher._waiting[-1])
        notify()

    def record_admit(generations, free):
        admitted.extend(generations)
        return admit(generations, free)

    def record_fit(generations, free):
        out = fit(generations, free)
        cut.append(len(out) < len(generations))
        return out

    batcher._wake.notify, batcher._admit, batcher._fit_pages = arrive, record_admit, record_fit
    service = server_lib.Service({"api_key": KEY, "max_tokens": 32, "max_request_bytes": 65536,
                                  "max_prompts": 8}, batcher, tokenizer)
    try:
        with ServerThread(server_lib.create_app(service)) as server:
            paged = (server.url,)
            with ThreadPoolExecutor(64) as pool:
                together = list(pool.map(lambda b: post(paged, "/v1/completions", b), bodies))
    finally:
        batcher.stop()
    assert [r.status_code for r in together] == [200] * 64
    assert len(arrived) == 64 and [id(g) for g in admitted] == [id(g) for g in arrived]
    assert any(cut) and batcher.engine.pages.in_use == 0  # pages held requests back
    alone = [answer(post(live, "/v1/completions", b)) for b in bodies]
    assert [answer(r) for r in together] == alone