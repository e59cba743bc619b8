"""uvicorn's HTTP protocol, answering requests it cannot parse in the API's own error shape.

A request line or header that uvicorn's parser refuses never reaches the app, so FastAPI's handlers cannot
shape its 400; uvicorn writes a plain-text one. A client of an OpenAI-compatible server reads
``{"error": {...}}`` from every 4xx, so this protocol writes that instead (the connection is closed after it,
as uvicorn does).
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from acache.server.protocol import error_body


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """An error FastAPI raises itself (404 no route, 405 method) in the API's shape, as every other 4xx."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)


def json_error_protocol() -> type:
    """The protocol class uvicorn would pick (httptools when installed, else h11) with JSON 400s."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class JSONErrorHTTPProtocol(AutoHTTPProtocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(f"malformed HTTP request: {msg}")).encode()
            head = (f"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                    "connection: close\r\n\r\n").encode()
            self.transport.write(head + body)
            self.transport.close()

    return JSONErrorHTTPProtocol
