"""What a hostile client can do to the server: malformed requests on every endpoint, slow
and piled-up connections, foreign Host headers. One tiny model on 127.0.0.1 with short
read timeouts and a small connection cap; every request is bounded by socket timeouts."""

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from ml_collections import ConfigDict
from serving_utils import ServerThread, make_batcher, make_tokenizer

from easylm.serving import limits, server as server_lib

KEY = "limits-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
READ_TIMEOUT = 5.0
MAX_CONNECTIONS = 24


@pytest.fixture(scope="module")
def live():
    """(base url, port, Service, uvicorn.Server)."""
    tokenizer = make_tokenizer()
    batcher, _, _ = make_batcher(stop_token_ids=(tokenizer.eos_token_id,))
    service = server_lib.Service(
        {"api_key": KEY, "max_tokens": 40, "max_prompts": 4, "max_request_bytes": 16384,
         "read_timeout": READ_TIMEOUT, "max_connections": MAX_CONNECTIONS,
         "max_header_bytes": 4096, "allowed_hosts": "served.example"}, batcher, tokenizer)
    with ServerThread(server_lib.create_app(service),
                      **limits.uvicorn_settings(service.config)) as server:
        yield server.url, server.port, service, server.server
    batcher.stop()


def raw(port: int, data: bytes, timeout: float = 60) -> tuple[int, dict | None]:
    """Send bytes, read to the end: (status, JSON body or None if the body is not JSON)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    try:
        return int(head.split()[1]), json.loads(body)
    except ValueError:
        return int(head.split()[1]), None


def request(method: str, path: str, body: bytes = b"", headers: dict | None = None,
            length: bool = True) -> bytes:
    headers = {"Host": "127.0.0.1", "Connection": "close", **AUTH,
               **({"Content-Type": "application/json"} if body else {}), **(headers or {})}
    if length and method == "POST":
        headers.setdefault("Content-Length", str(len(body)))
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in headers.items()]
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body


def js(value) -> bytes:
    return json.dumps(value).encode()


# (what, raw request bytes, status, fragment of the error message)
DEEP = b"[" * 5000 + b"]" * 5000
HOSTILE = [
    # /v1/completions
    ("top_k over int32", request("POST", "/v1/completions", js({"prompt": "x", "top_k": 2**31})),
     400, "top_k"),
    ("top_p flushed to 0", request("POST", "/v1/completions", js({"prompt": "x", "top_p": 1e-39})),
     400, "top_p"),
    ("seed over int64", request("POST", "/v1/completions", js({"prompt": "x", "seed": 2**64})),
     400, "seed"),
    ("negative seed below int64", request("POST", "/v1/completions",
                                          js({"prompt": "x", "seed": -2**63 - 1})), 400, "seed"),
    ("Infinity temperature", request("POST", "/v1/completions",
                                     b'{"prompt": "x", "temperature": Infinity}'), 400, "temperature"),
    ("huge max_tokens", request("POST", "/v1/completions", js({"prompt": "x", "max_tokens": 10**30})),
     400, "max_tokens"),
    ("float max_tokens", request("POST", "/v1/completions", js({"prompt": "x", "max_tokens": 2.5})),
     400, "max_tokens"),
    ("logprobs 6", request("POST", "/v1/completions", js({"prompt": "x", "logprobs": 6})),
     400, "logprobs"),
    ("17 stop strings", request("POST", "/v1/completions", js({"prompt": "x", "stop": ["a"] * 17})),
     400, "stop"),
    ("surrogate stop", request("POST", "/v1/completions", b'{"prompt": "x", "stop": "\\ud800"}'),
     400, "stop"),
    ("surrogate prompt", request("POST", "/v1/completions", b'{"prompt": ["ok", "\\udbff"]}'),
     400, "prompt"),
    ("negative token id", request("POST", "/v1/completions", js({"prompt": [1, -5]})),
     400, "token ids"),
    ("prompt of mixed types", request("POST", "/v1/completions", js({"prompt": [1, "a"]})),
     400, "prompt"),
    ("5 prompts", request("POST", "/v1/completions", js({"prompt": ["a"] * 5})), 400, "max_prompts"),
    ("n 2**70", request("POST", "/v1/completions", js({"prompt": "x", "n": 2**70})), 400, "n="),
    ("best_of 2", request("POST", "/v1/completions", js({"prompt": "x", "best_of": 2})),
     400, "best_of"),
    ("echo of a prompt over the context", request("POST", "/v1/completions", js(
        {"prompt": list(range(1, 80)), "echo": True, "logprobs": 1, "max_tokens": 0})),
     400, "more than the context"),
    ("body not UTF-8", request("POST", "/v1/completions", b'{"prompt": "\xc3("}'), 400, "UTF-8"),
    ("JSON 5000 deep", request("POST", "/v1/completions", b'{"prompt": ' + DEEP + b"}"),
     400, "nested too deeply"),
    ("a JSON array body", request("POST", "/v1/completions", b"[1, 2]"), 400, "body"),
    ("an empty body", request("POST", "/v1/completions"), 400, "no body; send a JSON object"),
    ("text/plain body", request("POST", "/v1/completions", b"prompt=x",
                                {"Content-Type": "text/plain"}), 400, "body"),
    # /v1/chat/completions
    ("surrogate chat content", request("POST", "/v1/chat/completions", b'{"messages": '
                                       b'[{"role": "user", "content": "\\ud800"}]}'),
     400, "messages.0.content"),
    ("no messages", request("POST", "/v1/chat/completions", js({"messages": []})), 400, "messages"),
    ("image content part", request("POST", "/v1/chat/completions", js(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]})),
     400, "messages.0.content"),
    ("an image to a text model", request("POST", "/v1/chat/completions", js(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64,iVBORw0KGgo="}}]}]})), 400,
     "hold 1 image part(s), but this model reads no images"),
    ("top_logprobs 99", request("POST", "/v1/chat/completions", js(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99})),
     400, "top_logprobs"),
    ("chat top_k 10**6", request("POST", "/v1/chat/completions", js(
        {"messages": [{"role": "user", "content": "x"}], "top_k": 10**6})), 400, "top_k"),
    ("max_completion_tokens 0", request("POST", "/v1/chat/completions", js(
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0})),
     400, "max_completion_tokens"),
    # EasyLM endpoints
    ("surrogate EasyLM text", request("POST", "/loglikelihood", b'{"text": ["\\ud800"]}'),
     400, "text.0"),
    ("5 EasyLM texts", request("POST", "/loglikelihood", js({"text": ["a"] * 5})), 400, "text has 5"),
    ("text over the context", request("POST", "/loglikelihood", js({"text": ["dog " * 200]})),
     400, "does not fit the context"),
    ("rolling text not a list", request("POST", "/loglikelihood-rolling", js({"text": "a"})),
     400, "text"),
    ("rolling unknown field", request("POST", "/loglikelihood-rolling", js({"text": [], "x": 1})),
     400, "x: Extra inputs"),
    ("generate temperature 3", request("POST", "/generate",
                                       js({"prefix_text": ["a"], "temperature": 3})),
     400, "temperature"),
    ("generate surrogate prefix", request("POST", "/generate", b'{"prefix_text": ["\\udc00"]}'),
     400, "prefix_text.0"),
    ("greedy-until lengths differ", request("POST", "/greedy-until",
                                            js({"prefix_text": ["a"], "until": []})), 400, "until"),
    ("greedy-until 17 stops", request("POST", "/greedy-until",
                                      js({"prefix_text": ["a"], "until": [["."] * 17]})),
     400, "until.0"),
    ("chat prompt not text", request("POST", "/chat", js({"prompt": 5})), 400, "prompt"),
    ("chat surrogate context", request("POST", "/chat", b'{"prompt": "a", "context": "\\ud800"}'),
     400, "context"),
    # every path: methods, keys, hosts
    ("POST /health", request("POST", "/health"), 405, "Method Not Allowed"),
    ("GET /v1/completions", request("GET", "/v1/completions"), 405, "Method Not Allowed"),
    ("POST /v1/models", request("POST", "/v1/models"), 405, "Method Not Allowed"),
    ("/ready with a wrong key", request("GET", "/ready", headers={"Authorization": "Bearer x"}),
     401, "API key"),
    ("/v1/models with no key", request("GET", "/v1/models", headers={"Authorization": ""}),
     401, "API key"),
    ("/ from a foreign Host", request("GET", "/", headers={"Host": "attacker.example"}),
     400, "Host header 'attacker.example' is not allowed"),
    ("/health from a rebinding name", request("GET", "/health", headers={"Host": "127.0.0.1.evil.example:80"}),
     400, "--allowed_hosts"),
    ("no Host", request("GET", "/health", headers={"Host": ""}), 400, "Host header"),
    # HTTP itself
    ("Content-Length not a number", request("POST", "/v1/completions", b"{}",
                                            {"Content-Length": "abc"}), 400, "bad Content-Length"),
    ("two Content-Lengths", request("POST", "/v1/completions", b"{}", {"Content-Length": "2",
                                                                     "content-length": "3"}),
     400, "Content-Length"),
    ("chunked body, no Content-Length", request("POST", "/loglikelihood", b"0\r\n\r\n",
                                                {"Transfer-Encoding": "chunked"}, length=False),
     411, "Content-Length header is required"),
    ("body over the limit", request("POST", "/loglikelihood", b"{}", {"Content-Length": "17000"}),
     413, "--max_request_bytes"),
    ("headers over the limit", request("GET", "/health", headers={"X-Pad": "a" * 5000}),
     431, "--max_header_bytes"),
    ("unfinished headers over the limit", request("GET", "/health", headers={"X-Pad": "a" * 5000})[:-4],
     431, "--max_header_bytes"),
    ("garbage request line", b"HELLO\r\n\r\n", 400, "malformed HTTP request"),
    ("non-ASCII request line", b"GET /\xff HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 400,
     "malformed HTTP request"),
]


def test_a_hostile_client_gets_json_4xx_and_nobody_else_notices(live):
    url, port, service, _ = live
    assert len(HOSTILE) >= 40
    normal = [("/v1/completions", {"prompt": "The quick brown", "max_tokens": 30,
                                   "temperature": 0}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                        "max_tokens": 30, "temperature": 0}),
              ("/greedy-until", {"prefix_text": ["Serving"], "until": ["\n\n"]})]

    def answer(path, body):
        response = httpx.post(url + path, json=body, headers=AUTH, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices" if path.startswith("/v1") else "output_text"]

    before = [answer(*n) for n in normal]
    with ThreadPoolExecutor(8) as pool:
        in_flight = [pool.submit(answer, *n) for n in normal]  # generating meanwhile
        replies = list(pool.map(lambda case: raw(port, case[1]), HOSTILE))
        during = [f.result() for f in in_flight]
    failures = []
    for (what, _, status, fragment), (got, body) in zip(HOSTILE, replies):
        message = (body or {}).get("error", {}).get("message", "")
        if got != status or fragment not in message:
            failures.append(f"{what}: {got} {body}")
    assert not failures, "\n".join(failures)
    assert not [r for r in replies if r[0] >= 500]
    assert during == before
    assert [answer(*n) for n in normal] == before


def test_slow_and_piled_up_connections_are_closed(live):
    """Connections that never finish a request get a 408 after --read_timeout and are
    closed; above --max_connections a new one gets a 503 at once; then all is as before."""
    url, port, _, _ = live
    body = js({"prompt": "x", "max_tokens": 2})
    stalls = [b"", b"POST /v1/comp", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",
              request("POST", "/v1/completions", body)[:-4]]  # everything but the body's end
    sockets = []
    for i in range(MAX_CONNECTIONS):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(stalls[i % len(stalls)])
        sockets.append(s)
    try:
        # Wait until the server holds all of them, then one more is refused.
        status, error = None, None
        for _ in range(50):
            status, error = raw(port, request("GET", "/health"), timeout=30)
            if status == 503:
                break
        assert status == 503 and "--max_connections" in error["error"]["message"]
        for s in sockets:  # recv returns b"" once the server closes: bounded by the timeout
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408 "), reply
            assert b"--read_timeout" in reply
    finally:
        for s in sockets:
            s.close()
    assert httpx.get(url + "/health", headers=AUTH).json()["status"] == "ok"


def test_the_read_deadline_ends_when_a_request_is_read(live):
    """A request read in full has no deadline while it is served (a long generation is
    not cut), and a kept-alive connection gets a new one with its next request."""
    url, _, service, server = live
    hold, held = threading.Event(), threading.Event()
    service.batcher.run(lambda: (held.set(), hold.wait(60)))  # the answer waits for `hold`
    assert held.wait(60)
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http, \
            ThreadPoolExecutor(1) as pool:
        try:
            reply = pool.submit(http.post, "/v1/completions", json={"prompt": "a", "max_tokens": 2})
            for _ in range(400):  # bounded: the server has parsed the request
                serving = [c for c in server.server_state.connections if c.cycle is not None]
                if serving:
                    break
                threading.Event().wait(0.05)
            assert serving and all(c._deadline is None for c in serving)
        finally:
            hold.set()
        assert reply.result().status_code == 200
        assert all(http.get("/health").status_code == 200 for _ in range(3))  # one connection
    assert server.server_state.total_requests >= 4


@pytest.mark.parametrize("host,status", [
    ("127.0.0.1:5007", 200), ("localhost", 200), ("LOCALHOST.:80", 200), ("[::1]:5007", 200),
    ("127.8.9.10", 200), ("served.example:5007", 200),
    ("attacker.example", 400), ("localhost.attacker.example", 400), ("0.0.0.0", 400),
    ("[::ffff:8.8.8.8]", 400), ("192.168.1.2:5007", 400),
])
def test_a_loopback_server_answers_loopback_hosts_only(live, host, status):
    _, port, _, _ = live
    assert raw(port, request("GET", "/health", headers={"Host": host}))[0] == status


def test_host_check_follows_the_bind_address():
    def hosts(host, allowed=""):
        return limits.allowed_hosts(ConfigDict({"host": host, "allowed_hosts": allowed}))

    assert hosts("127.0.0.1") == set() and hosts("localhost") == set()
    assert hosts("::1", "a.example, B.example") == {"a.example", "b.example"}
    assert hosts("0.0.0.0") is None  # on the network the API key protects it
    assert hosts("0.0.0.0", "a.example") == {"a.example"}
    assert hosts("127.0.0.1", "*") is None
