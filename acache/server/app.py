"""The FastAPI application: the server's shared parts built once, the routes, and the mapping of errors to
statuses. Each route family's work is a handler class of its own (``serving_*.py``), as in vLLM."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from acache.llm import LLM
from acache.scoring import DEFAULT_SAMPLES
from acache.server.affix_reuse import AffixRegistry, AutoAffixer
from acache.server.async_engine import AsyncEngine
from acache.server.guard import Guard
from acache.server.http import http_error
from acache.server.logprobs import DEFAULT_SCORING_TOKENS, Scorer
from acache.server.metrics import metrics_registry, render_metrics
from acache.server.protocol import (
    AffixRegistration,
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelNotFound,
    TokenizeRequest,
    error_body,
)
from acache.server.reuse_gate import ReuseGate
from acache.server.serving import ClientGone, RequestError, ServerContext
from acache.server.serving_affixes import OpenAIServingAffixes
from acache.server.serving_chat import OpenAIServingChat
from acache.server.serving_completion import OpenAIServingCompletion
from acache.server.serving_tokenization import OpenAIServingTokenization
from acache.server.shutdown import Drain, ShuttingDown

SCORING_REQUESTS = 8  # scoring requests that may wait for, or share, one pass
log = logging.getLogger("acache.server")


async def finish_checks(running: set[asyncio.Task], grace_s: float) -> None:
    """Lets the reuse checks still running when the server stops finish within what is left of the grace
    period, then cancels the rest. A check outlives its answer (the client had the answer without reuse), so
    uvicorn, which waits for open connections only, would otherwise cut it off: its record and the shared
    affix it computed, which ``--affix-cache-dir`` is about to save, would be lost."""
    pending = set(running)
    if pending and grace_s > 0:
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    for task in pending:
        task.cancel()
    if pending:  # each has handled its cancellation (aborted its engine request) before the engine stops
        await asyncio.gather(*pending, return_exceptions=True)


def create_app(llm: LLM, model_name: str, api_key: str | None = None, max_request_bytes: int = 1 << 20,
               min_document_tokens: int = 128, affix_cache_dir: Path | None = None,
               affix_registry_bytes: int = 64 << 20, loglikelihood_samples: int = DEFAULT_SAMPLES,
               max_scoring_tokens: int = DEFAULT_SCORING_TOKENS,
               auto_reuse: str = "verified", reuse_checks: int = 4, reuse_audit_every: int = 16) -> FastAPI:
    if isinstance(loglikelihood_samples, bool) or not isinstance(loglikelihood_samples, int) \
            or loglikelihood_samples <= 0:
        raise ValueError(f"loglikelihood_samples must be a positive integer, got {loglikelihood_samples!r}")
    if affix_cache_dir is not None and llm.affix_store is None:
        raise ValueError(f"--affix-cache-dir: the {llm.model.family} family shares no affix K/V, so there is no "
                         "affix cache to keep")
    engine = AsyncEngine(llm.engine)
    ctx = ServerContext(
        llm=llm, model_name=model_name, engine=engine, drain=Drain(engine.cancel_all),
        scorer=Scorer(llm.model, llm.tokenizer, loglikelihood_samples, engine.lock, max_scoring_tokens,
                      llm.engine_config.max_num_batched_tokens),
        # scoring on threads of its own (it never starves the shared pool the handlers use); requests scoring
        # at the same time share passes (Scorer.shared), one pass running at a time
        score_pool=ThreadPoolExecutor(max_workers=SCORING_REQUESTS, thread_name_prefix="acache-score"),
        registry=AffixRegistry(affix_registry_bytes),
        affixer=AutoAffixer(llm.inputs, lambda ids: llm.engine.affixes.lookup(ids) is not None,
                            min_document_tokens),
        gate=ReuseGate(auto_reuse, reuse_checks, reuse_audit_every), counters=Counter())
    completion, chat = OpenAIServingCompletion(ctx), OpenAIServingChat(ctx)
    affixes, tokenization = OpenAIServingAffixes(ctx, affix_cache_dir), OpenAIServingTokenization(ctx)
    affixes.load()

    closed = []

    def close() -> None:
        """Cancels what still runs, stops the engine, saves the affixes (with ``affix_cache_dir``); once. The
        lifespan's end calls it, and the CLI after a forced quit, where uvicorn skips the lifespan's end."""
        if closed:
            return
        closed.append(True)
        ctx.drain.expire()  # whatever the grace period left running stops now
        ctx.score_pool.shutdown(wait=False, cancel_futures=True)
        if not engine.started and llm.engine.served:  # refused at its start: another app serves the LLM
            return
        engine.shutdown()
        if affix_cache_dir is not None:
            try:
                log.warning("saved %d shared affixes to %s", affixes.save(), affix_cache_dir)
            except Exception as exc:  # a full disk, a directory made unwritable: said, and the shutdown goes on
                log.error("could not save the shared affixes to %s: %s", affix_cache_dir, exc)
        if engine.stopped:
            llm.close()  # the tensor-parallel ranks, if any; never while the engine thread may step

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await finish_checks(ctx.checks_running, ctx.drain.remaining())
            close()

    app = FastAPI(title="acache", description="OpenAI-compatible server for diffusion LLMs with ACache",
                  lifespan=lifespan)
    for name in ("engine", "affixer", "registry", "counters", "gate", "drain", "scorer", "checks_running"):
        setattr(app.state, name, getattr(ctx, name))
    app.state.save_affixes = affixes.save  # a cluster replica saves the same way when Serve stops it
    app.state.close = close
    counters = ctx.counters
    registry_metrics = metrics_registry(llm.engine, counters, ctx.gate)

    def error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        counters[f"http_errors_{status}_total"] += 1
        return JSONResponse(error_body(message, kind, code=code), status_code=status)

    app.add_middleware(Guard, max_bytes=max_request_bytes, api_key=api_key,
                       on_error=lambda status: counters.update({f"http_errors_{status}_total": 1}))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        kind = first.get("type", "")
        if kind == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
        elif kind == "extra_forbidden":
            message = f"unknown field '{where}'"
        else:
            message = f"{where}: {first.get('msg', 'invalid value')}" if where else first.get("msg", "invalid body")
        return error(400, message)

    app.add_exception_handler(StarletteHTTPException, http_error)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest):
        return error(400, str(exc))

    @app.exception_handler(ModelNotFound)
    async def _no_model(request: Request, exc: ModelNotFound):
        return error(404, str(exc), "not_found_error", code="model_not_found")

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        counters["requests_abandoned_total"] += 1
        return error(499, "the client closed the request")

    @app.exception_handler(ShuttingDown)
    async def _shutting_down(request: Request, exc: ShuttingDown):
        return error(503, str(exc), "server_error", code="shutting_down")

    @app.exception_handler(RequestError)
    async def _failed(request: Request, exc: RequestError):
        return error(500, str(exc), "server_error")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path, exc_info=exc)
        return error(500, "internal error; the server log has the details", "server_error")

    @app.get("/health")
    async def health():
        if ctx.drain.started:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if engine.dead is not None:  # the engine thread has stopped: nothing will be served
            return JSONResponse({"status": "error", "error": f"the engine failed: {type(engine.dead).__name__}"},
                                status_code=503)
        if engine.error is not None:  # a step failed its requests and the engine served on: still healthy
            return {"status": "ok", "last_step_error": f"{type(engine.error).__name__}: {engine.error}"}
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [completion.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            return error(404, f"model {model_id!r} is not served here; this server serves {model_name!r}",
                         "not_found_error", code="model_not_found")
        return completion.model_card()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(registry_metrics))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await tokenization.detokenize(body)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """What a remote client needs to tokenize as the server does (lm-eval's ``tokenizer_backend=remote``)."""
        return tokenization.info()

    @app.post("/v1/affixes/save")
    async def save_affix_cache():
        return await affixes.save_route()

    @app.post("/v1/affixes")
    async def register_affix(body: AffixRegistration):
        return await affixes.register(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await completion.create(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat.create(body, request)

    return app
