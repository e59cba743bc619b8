"""The door before the app: the API key, and the body limit counted on the bytes actually received,
whatever the headers claim (a chunked body has no Content-Length). A plain ASGI middleware, so that the
app still sees a client's disconnect."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from acache.server.protocol import error_body

TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


def protected(path: str) -> bool:
    """The paths that need the API key where there is one: /v1 and the tokenizer endpoints."""
    return path.startswith("/v1") or path in TOKENIZER_PATHS


def authorized(header: str, key: str) -> bool:
    """``Bearer <key>`` (the scheme in any case), compared in constant time."""
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class Guard:
    """Answers 401 on /v1 and the tokenizer endpoints without the API key (when there is one); reads a request's body up
    to ``max_bytes`` before the app sees it and answers 413 past that; the app then reads the buffered body
    as usual. ``on_error(status)`` counts each refusal."""

    def __init__(self, app, max_bytes: int, api_key: str | None = None,
                 on_error: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.api_key = api_key
        self.on_error = on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        key = headers.get(b"authorization", b"").decode("latin-1")
        if self.api_key is not None and protected(path) and not authorized(key, self.api_key):
            await self._refuse(send, 401, error_body("missing or wrong API key: send 'Authorization: Bearer <key>'",
                                                     "authentication_error", code="invalid_api_key"))
            return
        if scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send, int(declared))
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(send, size)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send, size: int) -> None:
        await self._refuse(send, 413, error_body(f"request body of at least {size} bytes exceeds the limit of "
                                                 f"{self.max_bytes}"))

    async def _refuse(self, send, status: int, body: dict) -> None:
        if self.on_error is not None:
            self.on_error(status)
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
