"""Every request passes here first (a plain ASGI middleware, so it holds whatever FastAPI's version):

- **other sites**: a request that changes anything (any method but GET/HEAD/OPTIONS) is refused with
  403 when the browser says it comes from another site: ``Sec-Fetch-Site`` other than
  ``same-origin``/``none``, or an ``Origin`` (else ``Referer``) other than this server's own. A page
  the user visits elsewhere can then neither start, stop nor delete a run, whatever content type it
  sends. Tools without a browser (curl, scripts) send neither header and are let through; there are
  no CORS headers, so no other site can read an answer either.
- **size**: a body over ``MAX_BODY_BYTES`` is refused with 413 before it is read, and never echoed.
- **token** (when the server has one): each request carries it as ``X-Token``,
  ``Authorization: Bearer`` or the session cookie. ``GET /?token=T`` exchanges it once for that
  cookie (HttpOnly, SameSite=Strict, holding a value derived from the token, not the token) and
  redirects to the same address without it, so it leaves the address bar and the history.
- **headers**: no referrer is sent from the page, it is not framed, and content types are not sniffed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple
from urllib.parse import urlencode, urlsplit

Scope = Dict[str, Any]
Receive = Callable[[], Awaitable[Dict[str, Any]]]
Send = Callable[[Dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
SAME_SITE = ("same-origin", "none")  # Sec-Fetch-Site: the page itself, or the user typing the address
MAX_BODY_BYTES = 2 * 2**20  # a training config is a few KiB (the CLI refuses over 4 MiB)
SESSION_COOKIE = "webui_session"
HEADERS = [(b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY"),
           (b"x-content-type-options", b"nosniff")]


def session_value(token: str) -> str:
    """The cookie's value: derived from the token, so a leaked cookie does not give the token away."""
    return hmac.new(token.encode(), b"webui-session", hashlib.sha256).hexdigest()


class Guard:
    """The ASGI middleware described above, around ``app``."""

    def __init__(self, app: App, token: Optional[str] = None):
        self.app = app
        self.token = token
        self.session = session_value(token) if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _respond(send, *refusal)
            return
        if self.token and scope["method"] == "GET" and _query_token(scope) is not None:
            await self._exchange(scope, send)
            return

        refused = False  # a body that grew past the limit: answered here, the app's answer dropped

        async def send_with_headers(message: Dict[str, Any]) -> None:
            if refused:
                return
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *HEADERS]}
            await send(message)

        async def refuse() -> None:
            nonlocal refused
            refused = True
            await _respond(send, 413, _too_large())

        await self.app(scope, _limited(receive, refuse), send_with_headers)

    def _refusal(self, scope: Scope, headers: Dict[str, str]) -> Optional[Tuple[int, str]]:
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return 413, _too_large()
        if scope["method"] not in SAFE_METHODS:
            site = headers.get("sec-fetch-site")
            if site is not None and site not in SAME_SITE:
                return 403, f"refused: a request from another site ({site}) may not change anything here"
            origin = headers.get("origin") or _origin_of(headers.get("referer"))
            if origin is not None and origin != _own_origin(scope, headers):
                return 403, "refused: a request from another origin may not change anything here"
        if self.token and not self._authorised(scope, headers):
            return 401, "a token is required (header X-Token, or open /?token=... once in the browser)"
        return None

    def _authorised(self, scope: Scope, headers: Dict[str, str]) -> bool:
        assert self.token is not None and self.session is not None
        bearer = headers.get("authorization", "")
        given = [headers.get("x-token"), bearer[7:] if bearer.lower().startswith("bearer ") else None,
                 _query_token(scope) if scope["method"] == "GET" else None]
        if any(g and hmac.compare_digest(g.encode(), self.token.encode()) for g in given):
            return True
        cookie = _cookies(headers).get(SESSION_COOKIE)
        return bool(cookie) and hmac.compare_digest(cookie.encode(), self.session.encode())

    async def _exchange(self, scope: Scope, send: Send) -> None:
        """``?token=`` (already checked): the cookie, and the same address without the token."""
        query = [(k, v) for k, v in _query(scope) if k != "token"]
        location = scope.get("root_path", "") + scope["path"] + (f"?{urlencode(query)}" if query else "")
        cookie = f"{SESSION_COOKIE}={self.session}; Path=/; HttpOnly; SameSite=Strict"
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", location.encode()), (b"set-cookie", cookie.encode()),
                                (b"cache-control", b"no-store"), (b"content-length", b"0"), *HEADERS]})
        await send({"type": "http.response.body", "body": b""})


def _too_large() -> str:
    return f"request body over {MAX_BODY_BYTES // 2**20} MiB refused (a training config is a few KiB)"


def _limited(receive: Receive, refuse: Callable[[], Awaitable[None]]) -> Receive:
    """``receive`` that answers 413 once a body sent without a length passes the limit, and tells
    the app the client went (whatever its version does with that, its answer is not sent)."""
    seen = 0

    async def wrapped() -> Dict[str, Any]:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > MAX_BODY_BYTES:
                await refuse()
                return {"type": "http.disconnect"}
        return message

    return wrapped


async def _respond(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *HEADERS]})
    await send({"type": "http.response.body", "body": body})


def _headers(scope: Scope) -> Dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _query(scope: Scope) -> List[Tuple[str, str]]:
    from urllib.parse import parse_qsl

    return parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)


def _query_token(scope: Scope) -> Optional[str]:
    return next((v for k, v in _query(scope) if k == "token"), None)


def _cookies(headers: Dict[str, str]) -> Dict[str, str]:
    out = {}
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name:
            out[name] = value
    return out


def _origin_of(url: Optional[str]) -> Optional[str]:
    if not url:
        return None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else "null"


def _own_origin(scope: Scope, headers: Dict[str, str]) -> str:
    """This server's origin as the browser names it: the scheme and the Host it was reached by."""
    return f"{scope.get('scheme', 'http')}://{headers.get('host', '')}"
