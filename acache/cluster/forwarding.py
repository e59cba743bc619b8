"""An HTTP request carried from the frontend to an engine replica, and the replica's side of it: the request
run through the replica's own OpenAI app in process (ASGI), its response handed back as it is produced.
The replica serves exactly what the single-process server would: the same app, the same checks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    query: str = ""
    spans: tuple[tuple[str, int], ...] = ()  # the request's affixes: content hash, tokens (for the router)
    registered: tuple | None = None  # (token ids, messages, name) of the registered affix it names
    stream: bool = False


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[str, str], ...] = field(default_factory=tuple)


async def call_app(app, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Runs ``request`` through the ASGI ``app``: yields the response's start, then its body chunks. Closing
    the iterator early (the client went away) tells the app the client disconnected and cancels it."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
             "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
             "query_string": request.query.encode(), "root_path": "", "client": ("127.0.0.1", 0),
             "server": ("acache-replica", 0),
             "headers": [(k.lower().encode(), v.encode()) for k, v in request.headers]}
    outbox: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await outbox.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await outbox.put(None)

    task = asyncio.ensure_future(run())
    try:
        while True:
            message = await outbox.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple((k.decode(), v.decode())
                                                             for k, v in message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        with contextlib.suppress(Exception):  # raised after its response was sent: the app logged it
            await task
    finally:
        if not task.done():
            gone.set()
            task.cancel()
