"""Request body limits counted on the bytes actually received, whatever the headers claim (a chunked
body has no Content-Length)."""

from __future__ import annotations

import json
from collections.abc import Callable

from acache.server.protocol import error_body


class BodyLimit:
    """ASGI middleware: reads a request's body up to ``max_bytes`` before the app sees it and answers 413
    past that; the app then reads the buffered body as usual."""

    def __init__(self, app, max_bytes: int, on_reject: Callable[[], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
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
        if self.on_reject is not None:
            self.on_reject()
        payload = json.dumps(error_body(f"request body of at least {size} bytes exceeds the limit of "
                                        f"{self.max_bytes}")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
