"""The HTTP server: one FastAPI app over a `Batcher`, safe defaults for a shared host.

    /                  the chat page (static HTML/JS shipped in the package)
    /health, /ready    liveness and slot usage
    /v1/...            OpenAI-compatible API (openai_api.py)
    /loglikelihood ... EasyLM's API (easylm_api.py)

Every endpoint but the static page requires `Authorization: Bearer KEY` when
`--api_key` is set. Every error is a JSON body `{"error": {"message", "type",
"code"}}` with a 4xx status for bad input (FastAPI's 422 validation errors become
400s) that names the field; what bounds a client (body size, prompts per request,
read timeouts, connections, Host names) is in limits.py and docs/serving.md.
"""

import hmac
import importlib.resources
import logging
import re
import socket

import jax
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from ml_collections import ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from easylm.errors import UserError
from easylm.serving import easylm_api, limits, openai_api
from easylm.serving.batcher import Batcher

# The routes' shared pieces live in service.py (no import cycle); these are re-exported
# here, where a server's setup looks for them.
from easylm.serving.service import HELP, APIError, Service, check_config, get_default_config  # noqa: F401

log = logging.getLogger(__name__)

def error_response(status: int, message: str, kind: str = "invalid_request_error"):
    return Response(limits.error_body(status, message, kind), status,
                    media_type="application/json")


def _validation_message(exc: RequestValidationError) -> str:
    parts = {}
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            return f"malformed JSON body: {error.get('ctx', {}).get('error', error['msg'])}"
        if tuple(error.get("loc", ())) == ("body",) and error.get("type") == "missing":
            return "the request has no body; send a JSON object"
        # pydantic names each member of a union in the location ('str', 'list[TextPart]',
        # 'function-after[...]'); the field's path is the rest, and its first error says enough.
        where = ".".join(str(p) for p in error.get("loc", ())
                         if p != "body" and not _UNION_MEMBER.fullmatch(str(p))) or "body"
        parts.setdefault(where, f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return "invalid request: " + "; ".join(parts.values())


_UNION_MEMBER = re.compile(r"str|int|float|bool|.*[\[(].*")


def _body_error_message(exc: Exception) -> str:
    """Why FastAPI could not read a JSON body (it raises a generic 400 from the cause)."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return (f"malformed JSON body: not UTF-8 (byte 0x{cause.object[cause.start]:02x} at "
                f"position {cause.start})")
    if isinstance(cause, RecursionError):
        return "malformed JSON body: nested too deeply"
    if cause is not None:
        return f"malformed JSON body: {type(cause).__name__}: {cause}"
    return str(getattr(exc, "detail", exc))


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="easylm", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(limits.SizeLimit, max_bytes=service.config.max_request_bytes,
                       max_header_bytes=service.config.max_header_bytes)
    hosts = limits.allowed_hosts(service.config)
    if hosts is not None:  # added last: it runs first
        app.add_middleware(limits.HostCheck, allowed=hosts)

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
        if exc.status_code == 400:  # FastAPI's "There was an error parsing the body"
            return error_response(400, _body_error_message(exc))
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def bug(request, exc: Exception):  # logged with its traceback by uvicorn
        return error_response(500, f"internal error ({type(exc).__name__}); see the "
                                   f"server's log", "server_error")

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
        Server(uvicorn.Config(app, log_level="warning", **limits.uvicorn_settings(config))
               ).run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down cleanly, then re-raised it
        pass
    finally:
        # No thread left dispatching to the device while the interpreter shuts down (a daemon
        # thread still running at exit can abort the process: SIGABRT instead of exit 0).
        batcher.stop()
