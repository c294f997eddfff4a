"""The HTTP server: one FastAPI app over a `Batcher`, safe defaults for a shared host.

    /                  the chat page (static HTML/JS shipped in the package)
    /health, /ready    liveness and slot usage
    /v1/...            OpenAI-compatible API (openai_api.py)
    /loglikelihood ... EasyLM's API (easylm_api.py)

Every endpoint but the static page requires `Authorization: Bearer KEY` when
`--api_key` is set. Request bodies are capped at `--max_request_bytes`, and
every error is a JSON body `{"error": {"message", "type", "code"}}` with a 4xx
status for bad input (FastAPI's 422 validation errors become 400s).
"""

import asyncio
import hmac
import importlib.resources
import json
import logging
import socket
from typing import Sequence

import jax

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from ml_collections import ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from easylm.errors import UserError
from easylm.serving.batcher import Batcher, Generation, SamplingParams

log = logging.getLogger(__name__)

HELP = {
    "host": "address to bind; 127.0.0.1 serves this machine only, 0.0.0.0 every interface",
    "port": "TCP port (0: any free one; the ready line names it)",
    "api_key": "if set, every API request needs the header `Authorization: Bearer KEY`",
    "model_name": "the model id in /v1/models; requests naming another model get a 404",
    "max_request_bytes": "largest request body accepted (413 above)",
    "max_tokens": "largest max_tokens a request may ask for; also the default for chat",
    "chat_template": "Jinja chat template (a file path or the template itself); "
                     "empty: the tokenizer's own",
    "add_bos_token": "prepend the tokenizer's BOS token to text prompts (not to chat "
                     "templates or token-id prompts, which carry their own)",
    "chat_prepend_text": "EasyLM /chat: text before the whole conversation",
    "chat_user_prefix": "EasyLM /chat: text before each user message",
    "chat_user_suffix": "EasyLM /chat: text after each user message",
    "chat_lm_prefix": "EasyLM /chat: text before each model reply",
    "chat_lm_suffix": "EasyLM /chat: text after each model reply",
}


def get_default_config(updates=None) -> ConfigDict:
    config = ConfigDict()
    config.host = "127.0.0.1"
    config.port = 5007
    config.api_key = ""
    config.model_name = "easylm"
    config.max_request_bytes = 1 << 20
    config.max_tokens = 1024
    config.chat_template = ""
    config.add_bos_token = True
    config.chat_prepend_text = ""
    config.chat_user_prefix = "User: "
    config.chat_user_suffix = "\n"
    config.chat_lm_prefix = "Assistant: "
    config.chat_lm_suffix = "\n"
    if updates is not None:
        config.update(ConfigDict(updates).copy_and_resolve_references())
    return config


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            return f"malformed JSON body: {error.get('ctx', {}).get('error', error['msg'])}"
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return "invalid request: " + "; ".join(parts)


class Service:
    """What the API routes share: the tokenizer, the batcher, limits, and async helpers."""

    def __init__(self, config: ConfigDict, batcher: Batcher, tokenizer):
        self.config = get_default_config(config)
        self.batcher, self.tokenizer = batcher, tokenizer
        self.seq_length = batcher.engine.seq_length
        self.chat_template = _read_template(self.config.chat_template)
        bos = tokenizer.bos_token_id
        self.bos_id = bos if bos is not None else tokenizer.eos_token_id

    # ---------------------------------------------------------- validation

    def check_model(self, name: str | None):
        if name is not None and name != self.config.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", "model_not_found")

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        add_bos = self.config.add_bos_token if add_bos is None else add_bos
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        template = self.chat_template or self.tokenizer.chat_template
        if not template:
            raise APIError(400, "this model's tokenizer has no chat template; start the "
                                "server with --chat_template=FILE")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja errors, and templates that raise on bad role order
            raise APIError(400, f"the chat template rejected these messages: {e}")
        return self.encode(text, add_bos=False)

    def max_tokens(self, prompt: Sequence[int], requested: int | None, default: int | None = None,
                   field: str = "max_tokens") -> int:
        """The number of new tokens to generate, or a 400 naming the limit that is hit."""
        limit, room = self.config.max_tokens, self.seq_length - len(prompt)
        if not prompt:
            raise APIError(400, "the prompt is empty (no tokens to start from)")
        if room < 1:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; the context is "
                                f"{self.seq_length} tokens, so there is no room to generate")
        if requested is None:
            return min(default or limit, limit, room)
        if requested < 1:
            raise APIError(400, f"{field} must be >= 1, got {requested}")
        if requested > limit:
            raise APIError(400, f"{field}={requested} is above this server's limit of {limit}")
        if requested > room:
            raise APIError(400, f"the prompt has {len(prompt)} tokens and {field} is "
                                f"{requested}: together more than the context of "
                                f"{self.seq_length} tokens")
        return requested

    # ---------------------------------------------------------- running

    def start(self, prompts, params: Sequence[SamplingParams]):
        """Submit one generation per prompt; returns (generations, async iterator of
        (index, Event)). Closing the iterator early cancels what is still running."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        gens = [Generation(p, sp, self.tokenizer,
                           lambda e, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, e)))
                for i, (p, sp) in enumerate(zip(prompts, params))]
        for g in gens:
            self.batcher.submit(g)

        async def iterate():
            remaining = len(gens)
            try:
                while remaining:
                    index, event = await events.get()
                    if event.finish_reason or event.error:
                        remaining -= 1
                    yield index, event
            finally:
                for g in gens:
                    if g.finish_reason is None:
                        self.batcher.cancel(g)

        return gens, iterate()

    async def complete(self, request: Request, prompts, params: Sequence[SamplingParams]):
        """Run generations to the end; a client that disconnects cancels them (frees slots)."""
        gens, events = self.start(prompts, params)

        async def drain():
            async for _ in events:
                pass

        work = asyncio.ensure_future(drain())
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # its `finally` cancels the generations
        if not work.done() or work.cancelled():
            raise APIError(499, "client disconnected")
        for g in gens:
            if g.finish_reason == "error":
                raise APIError(500, "generation failed", "server_error")
        return gens

    async def run(self, fn, *args):
        """A device job (scoring) on the batcher's thread."""
        return await asyncio.wrap_future(self.batcher.run(fn, self.batcher.engine, *args))


async def _wait_for_disconnect(request: Request):
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _read_template(value: str) -> str:
    if not value:
        return ""
    if "{" in value:  # the template itself
        return value
    try:
        with open(value) as f:
            return f.read()
    except OSError as e:
        raise UserError(f"--chat_template={value!r}: cannot read it ({e.strerror})")


class BodyLimit:
    """ASGI middleware: 411 without Content-Length, 413 above the limit, before any parsing."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            length = dict(scope["headers"]).get(b"content-length")
            if length is None:
                response = error_response(411, "a Content-Length header is required")
                return await response(scope, receive, send)
            if not length.isdigit() or int(length) > self.max_bytes:
                response = error_response(
                    413, f"request body of {length.decode(errors='replace')} bytes is above "
                         f"the limit of {self.max_bytes} bytes")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(service: Service) -> FastAPI:
    from easylm.serving import easylm_api, openai_api

    app = FastAPI(title="easylm", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=service.config.max_request_bytes)

    def authorize(request: Request):
        key = service.config.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           "authentication_error")

    auth = [Depends(authorize)]

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return error_response(exc.status, exc.message, exc.kind)

    @app.exception_handler(UserError)
    async def user_error(request, exc: UserError):
        return error_response(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        return error_response(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    page = importlib.resources.files("easylm.serving").joinpath("static/chat.html").read_text()

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return page

    @app.get("/health", dependencies=auth)
    @app.get("/ready", dependencies=auth)  # EasyLM's client polls /ready
    async def health():
        slots = service.batcher.slots
        return {"status": "ok", "model": service.config.model_name,
                "slots": len(slots), "busy_slots": sum(s is not None for s in slots)}

    app.include_router(openai_api.router(service), dependencies=auth)
    app.include_router(easylm_api.router(service), dependencies=auth)
    return app


def sse(data) -> str:
    """One server-sent event carrying JSON (or the literal [DONE])."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def bind(config: ConfigDict) -> socket.socket:
    """The server's socket, bound before the model loads, so that a port already in use is
    one error line at once, not after minutes of loading. `--port=0` takes a free port."""
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as e:
        sock.close()
        raise UserError(f"--host={config.host} --port={config.port}: cannot listen there "
                        f"({e.strerror or e}); is another server running? pick another --port")
    return sock


def ready_line(config: ConfigDict, batcher: Batcher, port: int) -> str:
    """What a user needs once the server listens: where, which model, and its limits."""
    host = config.host
    if host in ("0.0.0.0", "::", ""):  # every interface: name this machine, not 0.0.0.0
        host = socket.gethostname()
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    engine = batcher.engine
    leaves = jax.tree.leaves(engine.params)
    parameters = sum(x.size for x in leaves)
    dtypes = "/".join(sorted({str(x.dtype) for x in leaves}))
    key = " | API key required" if config.api_key else ""
    return (f"ready: chat page {url}/ | OpenAI API {url}/v1 | model '{config.model_name}': "
            f"{parameters:,} parameters, {dtypes}, context {engine.seq_length} tokens, "
            f"{engine.batch_size} batch slots{key}")


def run(app: FastAPI, config: ConfigDict, batcher: Batcher, sock: socket.socket | None = None):
    """Serve until interrupted; prints the ready line once the socket accepts connections.
    uvicorn logs warnings and errors only: no per-request lines."""
    import uvicorn

    sock = sock or bind(config)
    ready = ready_line(config, batcher, sock.getsockname()[1])

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                print(ready, flush=True)

    try:
        Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down cleanly, then re-raised it
        pass
