"""The HTTP server: OpenAI client, EasyLM fields, lm-eval's scoring call, concurrency,
disconnects, bad input. One tiny model served by uvicorn on 127.0.0.1 for the module."""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from easylm.serving import server as server_lib
from numerics import logprob_atol_for
from serving_utils import ServerThread, log_softmax, make_batcher, make_tokenizer

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def live(tokenizer):
    """(base url, Service, model, params) of a running server."""
    batcher, model, params = make_batcher(stop_token_ids=(tokenizer.eos_token_id,))
    service = server_lib.Service({"api_key": KEY, "max_tokens": 32, "max_request_bytes": 4096},
                                 batcher, tokenizer)
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


def lm_eval_loglikelihood(response, ctxlen):
    """lm-evaluation-harness's parse_logprobs for local-completions, restated."""
    choice = response["choices"][0]["logprobs"]
    logprobs = choice["token_logprobs"][ctxlen:-1]
    tops = choice["top_logprobs"][ctxlen:-1]
    return sum(logprobs), all(lp == max(top.values()) for lp, top in zip(logprobs, tops))


def test_echo_logprobs_score_like_lm_eval_expects(live, tokenizer):
    _, service, model, params = live
    atol = logprob_atol_for(model, params)  # each number from another program
    context = [tokenizer.bos_token_id] + tokenizer("The quick brown")["input_ids"]
    continuation = tokenizer(" fox jumps")["input_ids"]
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
    ("n > 1", "/v1/completions", {"prompt": "x", "n": 2}, AUTH, 400, "n=2 is not supported"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 99999]}, AUTH, 400,
     "prompt token ids must be in [0, vocab_size)"),
    ("missing API key", "/v1/completions", {"prompt": "x"}, {}, 401, "missing or wrong API key"),
    ("wrong API key", "/v1/models", None, {"Authorization": "Bearer nope"}, 401,
     "missing or wrong API key"),
    ("body above the size limit", "/v1/completions", {"prompt": "x" * 5000}, AUTH, 413,
     "above the limit of 4096 bytes"),
    ("EasyLM lists of different lengths", "/loglikelihood",
     {"prefix_text": ["a"], "text": ["b", "c"]}, AUTH, 400, "prefix_text has 1 entries"),
    ("EasyLM unknown field", "/generate", {"prefix_text": ["a"], "temprature": 0}, AUTH, 400,
     "temprature: Extra inputs are not permitted"),
    ("unknown path", "/v2/nothing", {}, AUTH, 404, "Not Found"),
]


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
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
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
