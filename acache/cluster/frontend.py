"""The cluster's front door: the same OpenAI endpoints as the single server, each request forwarded to an
engine replica with its affix spans attached for the router. It tokenizes (no weights), keeps the registry
of affixes registered through it (so that any replica can serve an affix registered through another), and
retries a request whose replica died before answering."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray.serve.exceptions import RayServeException
from starlette.exceptions import HTTPException as StarletteHTTPException

from acache.affix.prompt import Affix, affix_key
from acache.cluster.forwarding import ForwardedRequest, ResponseStart
from acache.engine.llm_engine import EngineConfig
from acache.inputs import InputProcessor
from acache.models.loader import read_config
from acache.models.tokenizer import Tokenizer
from acache.server.affix_reuse import AffixRegistry, AutoAffixer
from acache.server.guard import authorized, protected
from acache.server.http import http_error
from acache.server.protocol import AffixRegistration, ChatCompletionRequest, error_body
from acache.server.serving_affixes import leading_affix_ids

log = logging.getLogger("acache.cluster")
STATS_WAIT_S = 5.0  # how long /cluster/stats waits for the affix directory
READY_TTL_S = 1.0  # how long a count of the running replicas is trusted before Serve is asked again
REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


@dataclass(frozen=True)
class FrontendSettings:
    model: str
    directory: str
    namespace: str
    max_model_len: int | None = None
    min_document_tokens: int = 128
    affix_registry_bytes: int = 64 << 20
    max_request_bytes: int = 1 << 20
    api_key: str | None = None
    retries: int = 1  # further replicas tried when one dies before answering
    replicas: int = 1  # /health is ready once this many engine replicas run
    app_name: str = "acache"  # the Serve application whose replicas /health counts


class SpanExtractor:
    """A request's affix spans as the replica will find them: a registered affix by id, a chat's candidate
    spans (earlier messages, long user messages) by the same rules as the single server."""

    def __init__(self, settings: FrontendSettings) -> None:
        family, config = read_config(settings.model)
        self.shares_affixes = not getattr(family, "state_cache", False)  # as the replica reads it: no affix K/V
        limit = EngineConfig(max_model_len=settings.max_model_len).model_len(config.max_position_embeddings)
        self.inputs = InputProcessor(Tokenizer.from_dir(settings.model), config, limit)  # as the replicas'
        self.affixer = AutoAffixer(self.inputs, min_document_tokens=settings.min_document_tokens)
        self.registry = AffixRegistry(settings.affix_registry_bytes)

    def spans(self, path: str, body: dict) -> tuple[tuple[tuple[str, int], ...], tuple | None]:
        """(spans, the registered affix the request names); nothing when the body is not one this knows
        (the replica answers it with the single server's error)."""
        registered = None
        if isinstance(body.get("affix"), str):
            try:
                registered = self.registry.get(body["affix"])
            except ValueError:
                return (), None
        if path == "/v1/completions":
            reuse = self.reuses(body.get("selector"), body.get("affix_reuse"))
            ids = registered[0] if registered and reuse else None
            return (((affix_key(ids), len(ids)),) if ids else ()), registered
        if path == "/v1/chat/completions":
            request = ChatCompletionRequest.model_validate(body)
            messages = [m.as_dict() for m in request.messages]
            count = 0
            if registered is not None and registered[1] is not None:
                messages, count = list(registered[1]) + messages, len(registered[1])
            reuse = self.reuses(request.selector, request.affix_reuse)
            segments = self.affixer.chat_candidates(messages, reuse, count)
            found = tuple((affix_key(s.token_ids), len(s.token_ids)) for s in segments if isinstance(s, Affix))
            return found, registered
        return (), registered

    def reuses(self, selector: object, affix_reuse: object) -> bool:
        """Whether the replica reuses the request's spans (a span it computes whole is not pinned to its holder)."""
        return selector != "off" and affix_reuse != "off" and self.shares_affixes

    def register(self, body: dict) -> None:
        """Mirrors a registration a replica accepted (the id is the content's hash: the same everywhere)."""
        reg = AffixRegistration.model_validate(body)
        if reg.text is not None:
            self.registry.register(self.inputs.encode_text(reg.text), None, reg.name)
        else:
            messages = [m.as_dict() for m in reg.messages]
            self.registry.register(leading_affix_ids(self.inputs, messages), messages, reg.name)


def error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
    return JSONResponse(error_body(message, kind), status_code=status)


def unreachable(exc: Exception) -> JSONResponse:
    """Serve's refusal while the application is deployed or deleted (DeploymentUnavailableError, back-pressure)."""
    return error(503, f"the engine replicas cannot be reached ({type(exc).__name__}); try again")


def unkeyed() -> JSONResponse:
    """The single server's answer to a request without the API key (:class:`acache.server.guard.Guard`)."""
    return JSONResponse(error_body("missing or wrong API key: send 'Authorization: Bearer <key>'",
                                   "authentication_error", code="invalid_api_key"), status_code=401)


async def read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None once it passes ``limit`` bytes (counted as received, whatever the headers say)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def running_replicas(app_name: str, deployment: str = "EngineReplica") -> int:
    """Replicas of ``deployment`` that Serve reports RUNNING (started, and passing their health checks)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    states = app.deployments[deployment].replica_states if app and deployment in app.deployments else {}
    return int(states.get("RUNNING", 0))


class RunningCount:
    """``ready()``, asked off the event loop by one call at a time, whatever the number of requests waiting on it: a
    request with no replica running is answered 503 at once, where Serve would hold it until one runs (for ever, if
    replacements keep failing). A count of running replicas is trusted for :data:`READY_TTL_S`; none running is asked
    again at the next request, so a cluster that has just started serves as soon as Serve says so."""

    def __init__(self, ready: Callable[[], int]) -> None:
        self.ready = ready
        self.value: int | None = None
        self.at = float("-inf")
        self._asking: asyncio.Future | None = None

    def set(self, value: int | None) -> None:
        self.value, self.at = value, time.monotonic()

    async def get(self) -> int | None:
        """The count, or None when Serve cannot be asked (the request then goes on, and Serve decides)."""
        fresh = time.monotonic() - self.at < READY_TTL_S and bool(self.value)
        if not fresh:
            if self._asking is None:
                self._asking = asyncio.ensure_future(self._ask())
            await asyncio.shield(self._asking)  # a caller that leaves does not cancel the others' answer
        return self.value

    async def _ask(self) -> None:
        try:
            self.set(await asyncio.to_thread(self.ready))
        except Exception:
            self.set(None)
        finally:
            self._asking = None


def build_frontend(settings: FrontendSettings, engine, directory, ready: Callable[[], int] | None = None) -> FastAPI:
    """The FastAPI app that forwards to ``engine`` (a Serve handle to the replicas); ``ready`` counts the
    replicas running (Serve's own status by default)."""
    extractor = SpanExtractor(settings)
    app = FastAPI(title="acache cluster", description="OpenAI-compatible front door of acache replicas")
    ready = ready or functools.partial(running_replicas, settings.app_name)
    count = RunningCount(ready)

    app.add_exception_handler(StarletteHTTPException, http_error)  # a 405, as the single server words it

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path, exc_info=exc)
        return error(500, "internal error; the front door's log has the details")

    @app.get("/health")
    async def health():
        """Ready only when every replica is: a load balancer must not send traffic to a half-started cluster."""
        try:
            running = await asyncio.to_thread(ready)
        except Exception as exc:  # Serve's controller cannot be asked: not ready, and say why
            return JSONResponse({"status": "unknown", "error": f"{type(exc).__name__}: {exc}"}, status_code=503)
        count.set(running)  # a request right after a 200 here finds the replicas running
        body = {"status": "ok" if running >= settings.replicas else "starting", "replicas_ready": running,
                "replicas": settings.replicas}
        return JSONResponse(body, status_code=200 if running >= settings.replicas else 503)

    async def forward(forwarded: ForwardedRequest) -> Response:
        if await count.get() == 0:
            return error(503, "no engine replica is running (the cluster is starting, or replacing one that failed); "
                              "try again")
        tries = settings.retries + 1
        for n in range(tries):
            try:
                stream = engine.options(stream=True).handle.remote(forwarded)
            except RayServeException as exc:  # Serve's own handler for these answers plain text: answered here
                return unreachable(exc)
            relayed = False
            try:
                start = await stream.__anext__()
                if not forwarded.stream:  # the whole answer before any byte goes out: a retry stays possible
                    body = b"".join([chunk async for chunk in stream])
                    return Response(body, status_code=start.status, headers=_headers(start))
                relayed = True
                return StreamingResponse(_relay(stream), status_code=start.status, headers=_headers(start))
            except StopAsyncIteration:
                return error(502, "the replica ended the request without an answer")
            except ray.exceptions.RayTaskError as exc:  # raised by the replica's own code: a retry would too
                log.warning("replica failed on %s: %s", forwarded.path, exc)
                return error(500, "the replica failed on this request; its log has the details")
            except REPLICA_GONE as exc:
                log.warning("replica gone while serving %s (try %d of %d): %s", forwarded.path, n + 1, tries, exc)
                last = exc
            except RayServeException as exc:
                return unreachable(exc)
            finally:
                if not relayed:  # a client that went away (or a failed try) cancels the replica's work
                    stream.cancel()
        return error(503, f"the replica serving this request died and {tries - 1} retry failed too "
                          f"({type(last).__name__}); the cluster is replacing it, try again")

    def keyed(request: Request) -> bool:
        return settings.api_key is None or authorized(request.headers.get("authorization", ""), settings.api_key)

    @app.get("/cluster/stats")
    async def stats(request: Request):
        """Per replica: shared affixes held, affix hits and queries (from the replicas' own reports)."""
        if not keyed(request):
            return unkeyed()
        try:
            return await asyncio.wait_for(asyncio.ensure_future(directory.snapshot.remote()), STATS_WAIT_S)
        except Exception as exc:  # restarting, or cannot be placed: say so rather than hold the caller
            return error(503, f"the affix directory did not answer in {STATS_WAIT_S:g} s "
                              f"({type(exc).__name__}); try again")

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT"])
    async def relay(path: str, request: Request):
        path = "/" + path
        trusted = keyed(request)
        if protected(path) and not trusted:  # refused here, as the single server refuses it: no body read, no replica
            return unkeyed()
        body = await read_body(request, settings.max_request_bytes)
        if body is None:
            return error(413, f"request body exceeds {settings.max_request_bytes} bytes", "invalid_request_error")
        headers = tuple((k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS)
        parsed: object = None
        spans, registered = (), None
        if trusted and request.method == "POST" and body:
            try:
                parsed = json.loads(body)
            except ValueError:  # a body the replica will refuse, with the single server's message
                parsed = None
        stream = isinstance(parsed, dict) and parsed.get("stream") is True
        if isinstance(parsed, dict):
            try:  # tokenizing a large body: off the event loop that relays every stream
                spans, registered = await asyncio.to_thread(extractor.spans, path, parsed)
            except Exception:  # the replica answers it, with the single server's message
                spans, registered = (), None
        forwarded = ForwardedRequest(request.method, path, body, headers, request.url.query, spans, registered,
                                     stream=stream)
        response = await forward(forwarded)
        if path == "/v1/affixes" and response.status_code == 200 and isinstance(parsed, dict):
            try:
                await asyncio.to_thread(extractor.register, parsed)
            except Exception as exc:  # the replica accepted it, so this should not happen: say so
                log.warning("could not mirror an affix registration: %s", exc)
        return response

    return app


def _headers(start: ResponseStart) -> dict[str, str]:
    return {k: v for k, v in start.headers if k.lower() not in HOP_HEADERS}


async def _relay(stream) -> AsyncIterator[bytes]:
    """A streamed answer's chunks; a replica that dies mid-stream ends it with an error event (what was sent
    cannot be taken back, so it is not retried). A client that goes away cancels the replica's work."""
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    except REPLICA_GONE as exc:
        finished = True
        message = f"the replica serving this stream died ({type(exc).__name__}); the answer is incomplete"
        yield f"data: {json.dumps(error_body(message, 'server_error'))}\n\n".encode()
    finally:
        if not finished:
            stream.cancel()
