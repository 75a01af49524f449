"""The checks every /v1 request passes before a route sees it, as pure ASGI middleware: the API key, the content
type and the body's size. Pure ASGI, not Starlette's BaseHTTPMiddleware, so the route still sees the client's http.disconnect (with
BaseHTTPMiddleware `request.is_disconnected()` never turns true, and a non-streamed request would run on after its
client left). Shared by bmc-serve and its router."""
from __future__ import annotations

import hmac
import json
import email.message
from typing import Any, Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .protocol import APIError


def is_json(content_type: str) -> bool:
    m = email.message.Message()
    m["content-type"] = content_type
    sub = m.get_content_subtype()
    return m.get_content_maintype() == "application" and (sub == "json" or sub.endswith("+json"))


GATED = ("/v1", "/tokenize", "/detokenize")  # what the key and the body checks cover (/health, /metrics are open)


class RequestGate:
    """401 without `Authorization: Bearer KEY` (the scheme in any case, as RFC 7235 says) on GATED routes when a key is
    set; 415 for a POST whose body is declared as anything but JSON (a missing content type is read as JSON);
    413 for a body over `max_body_bytes`, at once when Content-Length says so, else as soon as the bytes read pass
    it (an HTTPException the app's handler answers). CORS preflights (OPTIONS) pass: the CORS middleware outside
    answers them. (Starlette's own body limit answers 413 in plain text, not as an OpenAI error.)"""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 on_error: Callable[[int], None] = lambda status: None) -> None:
        self.app, self.on_error, self.max_body_bytes = app, on_error, max_body_bytes
        self.key = api_key.encode() if api_key is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GATED) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        error = None
        if self.key is not None:
            scheme, _, token = headers.get("authorization", b"").decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self.key):
                error = APIError(401, "invalid or missing API key (Authorization: Bearer ...)")
        if error is None and scope["method"] == "POST" and "content-type" in headers:
            content_type = headers["content-type"].decode("latin-1")
            if not is_json(content_type):
                error = APIError(415, f"the body must be JSON (Content-Type: application/json), got {content_type!r}")
        declared = headers.get("content-length", b"").decode("latin-1")
        if error is None and declared.isdigit() and int(declared) > self.max_body_bytes:
            error = self.too_large()
        if error is None:
            await self.app(scope, self.limited(receive), send)
            return
        self.on_error(error.status)
        await send_json(send, error.status, error.body())

    def too_large(self) -> APIError:
        return APIError(413, f"the body is larger than --max-body-bytes ({self.max_body_bytes} bytes)")

    def limited(self, receive: Receive) -> Receive:
        seen = 0

        async def receive_limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise HTTPException(413, self.too_large().message)
            return message
        return receive_limited


async def send_json(send: Send, status: int, body: Any) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
