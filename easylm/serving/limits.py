"""What one HTTP client can make the server hold: bytes, time, connections, hosts.

    SizeLimit        ASGI: 431 above --max_header_bytes, 411 without Content-Length,
                     413 above --max_request_bytes
    HostCheck        ASGI: on a loopback bind, only loopback Host headers (and
                     --allowed_hosts), so a DNS-rebinding web page cannot drive the API
    Protocol         uvicorn's h11 protocol with a read deadline (--read_timeout: a
                     request's line, headers and body, from its first byte or from the
                     connection's start), a connection cap (--max_connections) and JSON
                     errors for requests h11 cannot parse
    uvicorn_settings the uvicorn keyword arguments that put these in place

uvicorn itself closes idle keep-alive connections (--keep_alive_timeout), and h11
refuses to buffer more than --max_header_bytes of a request line and headers that
have not ended yet; headers that arrive whole in one read pass h11 at any size, so
SizeLimit counts them again. uvicorn has no read timeout of its own, and its
`limit_concurrency` answers requests over the limit but never closes the connections
that hold it, so both live here. Every error is the JSON shape the API uses:
{"error": {"message", "type", "code"}}.
"""

import functools
import ipaddress
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost",)


def error_body(status: int, message: str, kind: str = "invalid_request_error") -> bytes:
    # A message may quote client input that is not valid Unicode (lone surrogates).
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


async def send_error(send, status: int, message: str, kind: str = "invalid_request_error"):
    """Answer an ASGI http request with a JSON error (before the app sees it)."""
    body = error_body(status, message, kind)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


HEADERS_TOO_LARGE = "the request line and headers are above the limit (--max_header_bytes)"


class SizeLimit:
    """431 above the header limit; 411 without Content-Length, 413 above the body limit,
    before any parsing."""

    def __init__(self, app, max_bytes: int, max_header_bytes: int):
        self.app, self.max_bytes, self.max_header_bytes = app, max_bytes, max_header_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        size = len(scope["raw_path"]) + len(scope["query_string"]) + sum(
            len(k) + len(v) + 4 for k, v in scope["headers"])
        if size > self.max_header_bytes:
            return await send_error(send, 431, HEADERS_TOO_LARGE)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = dict(scope["headers"]).get(b"content-length")
            if length is None:
                return await send_error(send, 411, "a Content-Length header is required")
            # h11 has already rejected a Content-Length that is not a number.
            if int(length) > self.max_bytes:
                return await send_error(send, 413, f"request body of {int(length)} bytes is "
                                                   f"above the limit of {self.max_bytes} bytes "
                                                   f"(--max_request_bytes)")
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    host = host.strip("[]").rstrip(".").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """'Example.com:5007' -> 'example.com'; '[::1]:5007' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostCheck:
    """400 for a Host header that is neither a loopback name or address nor allowed.

    A browser page from any site can make its own name resolve to 127.0.0.1 (DNS
    rebinding) and then send requests to this server with that name as the Host: a
    loopback server without an API key would otherwise obey them.
    """

    def __init__(self, app, allowed: set[str]):
        self.app, self.allowed = app, {h.rstrip(".") for h in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            name = host_name(header).rstrip(".")
            if not (is_loopback(name) or name in self.allowed):
                return await send_error(
                    send, 400, f"Host header {header!r} is not allowed: this server is bound "
                               f"to a loopback address and answers loopback names only; "
                               f"add the name with --allowed_hosts")
        await self.app(scope, receive, send)


def allowed_hosts(config) -> set[str] | None:
    """The Host names HostCheck lets through besides loopback ones; None: no check."""
    names = {h.strip().lower() for h in config.allowed_hosts.split(",") if h.strip()}
    if "*" in names or (not names and not is_loopback(config.host)):
        return None  # a server bound to the network relies on --api_key instead
    return names


class Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read deadline, a connection cap and JSON errors."""

    def __init__(self, *args, read_timeout: float, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout, self.max_connections = read_timeout, max_connections
        self._deadline = None  # the timer that closes a request not read in time
        self._lingering = False  # answered and half-closed: what still comes is dropped
        self._parse_error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def next_event_recorded():  # so that the 400 can say what h11 found wrong
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._parse_error = e
                raise

        self.conn.next_event = next_event_recorded

    def connection_made(self, transport):
        super().connection_made(transport)
        self._arm()
        if len(self.connections) > self.max_connections:
            log.warning("refused a connection: %d open (--max_connections)",
                        len(self.connections) - 1)
            self._reply_and_close(503, f"the server has {self.max_connections} connections "
                                       f"open, its limit (--max_connections); try again later",
                                  "server_error")

    def connection_lost(self, exc):
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes):
        if self._lingering:
            return
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
            self._disarm()  # read in full (or failed): the app takes its own time

    def _arm(self):
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout, self._timed_out)

    def _disarm(self):
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self):
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._lingering or (self.cycle is not None and self.cycle.response_started):
            self.transport.close()  # answered already; the client never finished
            return
        # The client has sent nothing for a while: nothing unread that a close would reset.
        self._reply_and_close(408, f"the request was not received within "
                                   f"{self.read_timeout:g} s (--read_timeout)", linger=False)

    def send_400_response(self, msg: str):
        error = self._parse_error
        status = getattr(error, "error_status_hint", 400)
        if status == 431:
            return self._reply_and_close(431, HEADERS_TOO_LARGE)
        detail = str(error) if error is not None else msg
        self._reply_and_close(status, f"malformed HTTP request: {detail}")

    def _reply_and_close(self, status: int, message: str, kind: str = "invalid_request_error",
                         linger: bool = True):
        """Raw bytes: h11 may not be in a state where it would send a response (half a
        request line). With `linger`, only our side closes and what the client still sends
        is read and dropped until it closes or the read deadline passes: closing with
        unread data would reset the connection before the client reads the answer."""
        body = error_body(status, message, kind)
        head = (f"HTTP/1.1 {status} {STATUS_PHRASES[status].decode()}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                f"connection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        if linger and self.transport.can_write_eof():
            self.transport.write_eof()
            self._lingering = True
            self._arm()
        else:
            self.transport.close()


def uvicorn_settings(config) -> dict:
    """uvicorn.Config / uvicorn.run keyword arguments for the limits in `config`."""
    return {
        "http": functools.partial(Protocol, read_timeout=config.read_timeout,
                                  max_connections=config.max_connections),
        "timeout_keep_alive": config.keep_alive_timeout,
        "h11_max_incomplete_event_size": config.max_header_bytes,
    }
