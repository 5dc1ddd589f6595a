"""The live page's web server: a read-only starlette app (Flower brings starlette and
uvicorn) served by uvicorn on a thread of the process that runs the federation, so a
round costs the run nothing: the page reads the records that process already has.

Safe by default: it listens on loopback only and answers only the Host names of loopback
and of the address it listens on (a web page elsewhere cannot reach it through DNS
rebinding); any other address needs a token, which every request must then carry. The
token is given once, in the printed address (`?token=`); the answer sets a cookie that
carries it for the page's own requests (its scripts, its data): HttpOnly, SameSite=Strict,
the page's path, and holding a value derived from the token, not the token. Scripts may
send `Authorization: Bearer` instead. It has GET routes only, and shows no key, weight or
token."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import re
import socket
import threading
import time
from importlib.resources import files
from typing import Any
from urllib.parse import quote

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .state import PageState

log = logging.getLogger("fedlb.page")

# the Host names a loopback page answers ("testserver": starlette's TestClient)
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "testserver"})
MIN_TOKEN = 12  # characters: a token anyone could guess protects nothing


class PageError(ValueError):
    """Page settings that would expose it (another address without a token) or a port
    it cannot listen on: the message says what to do."""


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_binding(host: str, token: str | None) -> None:
    """PageError unless the page may listen on `host`: loopback needs nothing; any other
    address needs a token of at least MIN_TOKEN characters."""
    if is_loopback(host):
        return
    if not token:
        raise PageError(
            f"the live page on {host} would show the run to anyone who can reach it: give "
            f"--page-token (at least {MIN_TOKEN} characters) with --page-host, or leave "
            "--page-host out (this machine only)"
        )
    if len(token) < MIN_TOKEN:
        raise PageError(f"--page-token must have at least {MIN_TOKEN} characters")


# A Host header: a name or an address ([IPv6] bracketed), then at most a port of digits
HOST_HEADER = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(?::[0-9]{1,5})?")


def host_name(header: str) -> str:
    """A Host header's name without its port: "[::1]:8050" -> "[::1]"; '' for a header
    that is not a host and port ("127.0.0.1:8050@evil.example" was read as 127.0.0.1)."""
    found = HOST_HEADER.fullmatch(header)
    return found.group(1).lower() if found else ""


def same_token(given: str, token: str) -> bool:
    """Whether `given` is the token, in constant time. Their SHA-256 digests are compared,
    not HMACs keyed by them: HMAC pads a key with zero bytes, so "T" and "T\0" made the
    same cookie value and `?token=T%00` was let in."""
    digests = [hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest() for t in (given, token)]
    return hmac.compare_digest(*digests)


def _static(name: str) -> bytes:
    return files("fedlb.page").joinpath("static", name).read_bytes()


def cookie_value(token: str) -> str:
    """What the page's cookie holds: a value derived from the token (HMAC-SHA256), so
    that a browser's cookie store never holds the token itself."""
    return hmac.new(token.encode(), b"fedlb live page cookie", hashlib.sha256).hexdigest()


def cookie_name(scope: Any) -> str:
    """The cookie's name: one per port the page listens on, as a browser keeps cookies by
    host name but not by port (two runs' pages on one machine keep their own)."""
    server = scope.get("server") or ("", 0)
    return f"fedlb-page-{server[1]}"


REFUSED = (
    "this page needs its token: open the address fedlb printed when the run started "
    "(live page: http://...?token=...), or send Authorization: Bearer <token>\n"
)


def make_app(
    state: PageState, token: str | None = None, loopback: bool = True, host: str | None = None
) -> Starlette:
    """The page's app: `/` the page, `/api/state` its data, `/static/` its scripts and
    the vendored chart library. With `token`, every request must carry it (`?token=`,
    the cookie a `?token=` request gets, or `Authorization: Bearer`); with `loopback`,
    only loopback Host names are answered, and `host`'s (the address it listens on)."""
    hosts = set(LOOPBACK_HOSTS)
    if host:
        hosts.add(host_name(f"[{host.strip('[]')}]" if ":" in host else host))
    expected = cookie_value(token) if token else ""

    def admitted(request: Request) -> tuple[Response | None, bool]:
        """Why this request gets nothing (None: it may have the page), and whether its
        answer sets the page's cookie (a right `?token=`). Refused: a Host not the
        page's own on a loopback page, or no right token where the page has one."""
        if loopback and host_name(request.headers.get("host", "")) not in hosts:
            return PlainTextResponse("Invalid host header", status_code=400), False
        if not token:
            return None, False
        given = request.query_params.get("token")
        if given is not None and same_token(given, token):
            return None, True
        header = request.headers.get("authorization", "")
        if header[:7].lower() == "bearer " and same_token(header[7:].strip(), token):
            return None, False
        kept = request.cookies.get(cookie_name(request.scope), "")
        if hmac.compare_digest(kept.encode(), expected.encode()):
            return None, False
        return PlainTextResponse(
            REFUSED,
            status_code=401,
            headers={**NO_STORE, "WWW-Authenticate": 'Bearer realm="fedlb live page"'},
        ), False

    def remember(request: Request, response: Response) -> Response:
        """The page's cookie on the answer to a right `?token=`: the browser sends it with
        the page's own requests from then on; a session cookie, for this page's path and
        port only, out of reach of scripts and of other sites' requests."""
        response.set_cookie(
            cookie_name(request.scope),
            expected,
            path=(request.scope.get("root_path") or "") + "/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",  # plain http: a Secure cookie is dropped
        )
        return response

    async def index(request: Request) -> Response:
        no, keep = admitted(request)
        if no is not None:
            return no
        page = Response(
            _static("index.html"),
            media_type="text/html; charset=utf-8",
            # no-referrer: the address (its ?token=) goes nowhere with the page's requests
            headers={**NO_STORE, "Referrer-Policy": "no-referrer"},
        )
        return remember(request, page) if keep else page

    async def api_state(request: Request) -> Response:
        """The page's data; `?since=V` where the page already drew version V: only the
        version and the time, until a round changes it (a poll between rounds costs
        next to nothing, however many rounds the run has)."""
        no, keep = admitted(request)
        if no is not None:
            return no
        since = request.query_params.get("since", "")
        version = state.version
        if since.isdigit() and int(since) == version:
            body = json.dumps({"version": version, "unchanged": True, "now": time.time()})
        else:
            body = json.dumps(state.snapshot(), allow_nan=False)
        answer = Response(body, media_type="application/json", headers=NO_STORE)
        return remember(request, answer) if keep else answer

    class Guarded(StaticFiles):
        async def get_response(self, path: str, scope: Any) -> Response:
            request = Request(scope)
            no, keep = admitted(request)
            if no is not None:
                return no
            answer = await super().get_response(path, scope)
            return remember(request, answer) if keep else answer

    return Starlette(
        routes=[
            Route("/", index, methods=["GET"]),
            Route("/api/state", api_state, methods=["GET"]),
            Mount("/static", Guarded(directory=str(files("fedlb.page").joinpath("static")))),
        ],
    )


NO_STORE = {"Cache-Control": "no-store"}


class LivePage:
    """The page served on a thread until `stop()`: `LivePage(state).start()` returns once it
    listens; `url` is its address (with the token, where it has one: the address to open;
    the page keeps it in a cookie from there).

    Args:
        state: what it shows.
        host: where it listens; loopback unless a token is given (check_binding).
        port: its port (0: a free one).
        token: the token every request must carry (None: none, loopback only).
    """

    def __init__(
        self, state: PageState, host: str = "127.0.0.1", port: int = 0, token: str | None = None
    ) -> None:
        check_binding(host, token)
        self.state = state
        self.host, self.token = host, token or None
        self._port = port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    def start(self) -> LivePage:
        family = socket.AF_INET6 if ":" in self.host.strip("[]") else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host.strip("[]"), self._port))
        except OSError as error:
            sock.close()
            raise PageError(
                f"the live page cannot listen on {self.host}:{self._port} ({error.strerror}): "
                "give another --page-port (0: a free one), or --no-page"
            ) from None
        sock.listen(16)
        self._socket = sock
        self._port = sock.getsockname()[1]
        app = make_app(self.state, self.token, is_loopback(self.host), self.host)
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="off",
            access_log=False,
            loop="asyncio",
            ws="none",  # GET pages only: no websockets (nor their import)
        )
        self._server = uvicorn.Server(config)
        server = self._server
        self._thread = threading.Thread(
            target=lambda: server.run(sockets=[sock]), name="fedlb-page", daemon=True
        )
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self.host.strip('[]')}]" if ":" in self.host.strip("[]") else self.host
        token = f"?token={quote(self.token, safe='')}" if self.token else ""
        return f"http://{host}:{self._port}/{token}"

    def stop(self) -> None:
        """Stop serving (the run's end); a page open then keeps what it last showed."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._socket is not None:
            self._socket.close()

    def __enter__(self) -> LivePage:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
