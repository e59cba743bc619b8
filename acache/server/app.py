"""The FastAPI application: OpenAI-compatible completions and chat, affix registration, metrics."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from acache.affix.cache import model_fingerprint
from acache.affix.prompt import AffixPrompt, affix_key
from acache.inputs import InputProcessor
from acache.llm import LLM
from acache.models.config import affix_training
from acache.models.tokenizer import token_text
from acache.policies import AFFIX_POLICIES, DEFAULT_SELECTOR
from acache.sampling_params import SamplingParams
from acache.scoring import DEFAULT_SAMPLES, ScoringCancelled
from acache.server.affix_reuse import AffixRegistry, AutoAffixer
from acache.server.async_engine import AsyncEngine, EngineFailed, RequestFailed
from acache.server.guard import Guard
from acache.server.logprobs import Scorer
from acache.server.metrics import metrics_registry, render_metrics
from acache.server.protocol import (
    NEUTRAL,
    AffixRegistration,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DiffusionFields,
    TokenizeRequest,
    error_body,
)
from acache.server.reuse_gate import Decision, Plan, ReuseGate
from acache.server.shutdown import Drain, ShuttingDown
from acache.server.stops import Cut, cut_at_stop, held_back, stop_list

DEFAULTS = SamplingParams()
SCORING_REQUESTS = 8  # scoring requests that may wait for, or share, one pass
log = logging.getLogger("acache.server")


class BadRequest(ValueError):
    """A request the server refuses with 400."""


class RequestError(RuntimeError):
    """A request the engine failed alone: 500 with the engine's message, the server goes on."""


def sampling_params(body: DiffusionFields, reuse: bool, default_selector: str = DEFAULT_SELECTOR) -> SamplingParams:
    """Maps the request's fields to SamplingParams; ``max_tokens`` becomes whole blocks of gen_length; a reused
    affix without a ``selector`` takes the served model's ``default_selector``."""
    if body.n != 1:
        raise BadRequest("only n=1 is supported")
    for name, (neutral, why) in NEUTRAL.items():
        value = getattr(body, name, None)
        if not any(value == ok and type(value) is type(ok) or value is ok for ok in neutral):
            raise BadRequest(f"{name}={value!r} cannot be honoured by this diffusion model: {why}")
    if body.stream_options is not None:
        if not body.stream:
            raise BadRequest("stream_options is only allowed with stream=true")
        unknown = set(body.stream_options) - {"include_usage"}
        if unknown or not isinstance(body.stream_options.get("include_usage", False), bool):
            raise BadRequest(f"stream_options takes include_usage (a bool); got {body.stream_options!r}")
    limit = getattr(body, "max_completion_tokens", None)
    if limit is not None:
        if body.max_tokens is not None and body.max_tokens != limit:
            raise BadRequest(f"max_tokens ({body.max_tokens}) and max_completion_tokens ({limit}) disagree")
        body.max_tokens = limit
    if body.selector is not None and body.selector != "off" and body.selector not in AFFIX_POLICIES:
        raise BadRequest(f"selector must be one of {', '.join(AFFIX_POLICIES)} or 'off', got {body.selector!r}")
    block = body.block_length if body.block_length is not None else DEFAULTS.block_length
    gen = body.gen_length
    if gen is None and body.max_tokens is not None:
        if body.max_tokens <= 0:
            raise BadRequest(f"max_tokens must be positive, got {body.max_tokens}")
        block = min(block, body.max_tokens) if body.block_length is None and block > 0 else block
        gen = -(-body.max_tokens // block) * block if block > 0 else body.max_tokens
    if gen is None:
        gen = DEFAULTS.gen_length
    elif body.block_length is None and body.max_tokens is None and 0 < gen < block:
        block = gen  # a short generation region is one block

    selector = body.selector or default_selector
    kwargs = {"gen_length": gen, "block_length": block, "steps": body.steps, "seed": body.seed,
              "temperature": body.temperature if body.temperature is not None else DEFAULTS.temperature,
              "affix_policy": selector if reuse and selector != "off" else None}
    for name in ("threshold", "remasking", "factor", "anchor_ratio", "anchor_query", "far_mask_window", "focus_layers",
                 "focus_ratio"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    if body.probe_step and reuse:  # a chat whose spans are not (yet) shared affixes decodes as usual
        kwargs["probe_step"] = True
    if body.anchor_pass is not None and reuse and kwargs["affix_policy"] is not None:
        kwargs["anchor_pass"] = body.anchor_pass
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:  # name the request's fields, not SamplingParams'
        raise BadRequest(str(exc).replace("affix_policy", "selector").replace("gen_length", "gen_length (or "
                                                                            "max_tokens)")) from None


def create_app(llm: LLM, model_name: str, api_key: str | None = None, max_request_bytes: int = 1 << 20,
               min_document_tokens: int = 128, affix_cache_dir: Path | None = None,
               affix_registry_bytes: int = 64 << 20, loglikelihood_samples: int = DEFAULT_SAMPLES,
               auto_reuse: str = "verified", reuse_checks: int = 4, reuse_audit_every: int = 16) -> FastAPI:
    if isinstance(loglikelihood_samples, bool) or not isinstance(loglikelihood_samples, int) \
            or loglikelihood_samples <= 0:
        raise ValueError(f"loglikelihood_samples must be a positive integer, got {loglikelihood_samples!r}")
    engine = AsyncEngine(llm.engine)
    drain = Drain(engine.cancel_all)
    scorer = Scorer(llm.model, llm.tokenizer, loglikelihood_samples, engine.lock)
    # scoring on threads of its own (it never starves the shared pool the handlers use); requests scoring at
    # the same time share passes (Scorer.shared), one pass running at a time
    score_pool = ThreadPoolExecutor(max_workers=SCORING_REQUESTS, thread_name_prefix="acache-score")
    registry = AffixRegistry(affix_registry_bytes)
    fingerprint = model_fingerprint(llm.model) if affix_cache_dir is not None else ""
    if affix_cache_dir is not None:  # the ids given out before a restart stay valid; a bad file is set aside
        registry.load(affix_cache_dir, fingerprint, llm.config.vocab_size)
    affixer = AutoAffixer(llm.inputs, lambda ids: llm.engine.affixes.lookup(ids) is not None, min_document_tokens)
    gate = ReuseGate(auto_reuse, reuse_checks, reuse_audit_every)
    checks_running: set[asyncio.Task] = set()  # held here: the event loop keeps only weak references
    counters: Counter[str] = Counter()
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            drain.expire()  # whatever the grace period left running stops now
            score_pool.shutdown(wait=False, cancel_futures=True)
            engine.shutdown()
            if affix_cache_dir is not None:
                saved = save_affixes()
                log.warning("saved %d shared affixes to %s", saved, affix_cache_dir)
            if engine.stopped:
                llm.close()  # the tensor-parallel ranks, if any; never while the engine thread may step

    app = FastAPI(title="acache", description="OpenAI-compatible server for diffusion LLMs with ACache",
                  lifespan=lifespan)
    app.state.engine = engine
    app.state.affixer = affixer
    app.state.registry = registry
    app.state.counters = counters
    app.state.gate = gate
    app.state.drain = drain
    app.state.scorer = scorer
    app.state.checks_running = checks_running
    registry_metrics = metrics_registry(llm.engine, counters, gate)

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

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                     "invalid_request_error")

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest):
        return error(400, str(exc))

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
        if drain.started:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": f"the engine failed: {type(engine.error).__name__}"},
                                status_code=503)
        return {"status": "ok"}

    def model_card() -> dict:
        """OpenAI's model object, plus how this model's affixes are reused by default and why."""
        trained = affix_training(llm.config) is not None
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "acache",
                "max_model_len": llm.max_model_len,
                "affix_reuse": {"default_selector": llm.default_selector, "affix_trained": trained,
                                "mode": "direct reuse (trained to be reused)" if trained else
                                f"ACache: anchors chosen by {llm.default_selector}"}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            return error(404, f"model {model_id!r} is not served here; this server serves {model_name!r}",
                         "not_found_error", code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(registry_metrics))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give exactly one of prompt or messages")
        def encode() -> list[int]:
            try:
                if body.prompt is not None:
                    return llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
                text = llm.inputs.render_chat([m.as_dict() for m in body.messages], body.add_generation_prompt)
                return llm.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None

        ids = await asyncio.to_thread(encode)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body)
        vocab = llm.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return {"prompt": await asyncio.to_thread(llm.tokenizer.decode, body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """What a remote client needs to tokenize as the server does (lm-eval's ``tokenizer_backend=remote``)."""
        tok = llm.tokenizer
        return {"tokenizer_class": "acache.Tokenizer", "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": token_text(tok.config.get("pad_token")), "chat_template": tok.chat_template,
                "model_max_length": llm.max_model_len, "vocab_size": llm.config.vocab_size}

    def save_affixes() -> int:
        with engine.lock:  # the engine thread is not stepping while its pages are read
            llm.save_affix_cache(affix_cache_dir)
            saved = len(llm.engine.affixes)
        registry.save(affix_cache_dir, fingerprint)
        return saved

    app.state.save_affixes = save_affixes  # a cluster replica saves the same way when Serve stops it

    @app.post("/v1/affixes/save")
    async def save_affix_cache():
        if affix_cache_dir is None:
            raise BadRequest("this server has no --affix-cache-dir to save to")
        saved = await asyncio.to_thread(save_affixes)
        return {"object": "affix_cache", "saved": saved, "path": str(affix_cache_dir)}

    @app.post("/v1/affixes")
    async def register_affix(body: AffixRegistration):
        if (body.text is None) == (body.messages is None):
            raise BadRequest("give exactly one of text or messages")
        messages = None
        if body.text is not None:
            if not body.text.strip():
                raise BadRequest("text must not be empty")
            ids = await asyncio.to_thread(encode_text, body.text)
        else:
            if not body.messages:
                raise BadRequest("messages must not be empty")
            messages = [m.as_dict() for m in body.messages]
            try:
                ids = await asyncio.to_thread(leading_affix_ids, llm.inputs, messages)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        if len(ids) > llm.max_model_len:
            raise BadRequest(f"affix has {len(ids)} tokens, more than the model's context of "
                             f"{llm.max_model_len}")
        try:
            affix_id = registry.register(ids, messages, body.name)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        counters["affixes_registered_total"] += 1
        return {"id": affix_id, "object": "affix", "tokens": len(ids), "name": body.name}

    def encode_text(text: str) -> list[int]:
        try:
            return llm.inputs.encode_text(text)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    def check_model(body: DiffusionFields) -> None:
        if body.model is not None and body.model != model_name:
            raise BadRequest(f"model {body.model!r} is not served here; this server serves {model_name!r}")

    def prompt_fits(prompt: AffixPrompt, params: SamplingParams) -> None:
        """Every check the engine makes when a request is added (context, vocabulary, pool size, BiCache
        profile), made before any work or any streamed byte."""
        try:
            llm.engine.check_request(prompt, params)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        affix_ids, name = None, None
        if body.affix is not None:
            try:
                affix_ids, _, name = registry.get(body.affix)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        score_only = body.max_tokens == 0
        if score_only and not body.echo:
            raise BadRequest("max_tokens=0 generates nothing: it is allowed only with echo=true, which returns the "
                             "prompt (scored, with logprobs)")
        if score_only and body.stream:
            raise BadRequest("max_tokens=0 generates nothing to stream: use stream=false")
        if body.mc_samples is not None and body.logprobs is None:
            raise BadRequest("mc_samples sets the Monte Carlo draws of logprobs: pass logprobs too")
        scoring_allowed(body.logprobs is not None)
        if body.logprobs is not None and body.stream:
            raise BadRequest("logprobs are estimated once decoding ends: use stream=false")
        if body.logprobs is not None and body.suffix:
            raise BadRequest("logprobs with suffix (infilling) are not implemented: the generated tokens must end "
                             "the sequence")
        params = sampling_params(body.model_copy(update={"max_tokens": None}) if score_only else body,
                                 reuse=affix_ids is not None, default_selector=llm.default_selector)
        if body.selector not in (None, "off") and affix_ids is None:
            raise BadRequest("selector applies to a reused affix: pass 'affix' (an id from POST /v1/affixes)")
        for name in ("probe_step", "anchor_query", "anchor_pass"):
            if getattr(body, name) and affix_ids is None:
                raise BadRequest(f"{name} applies to a reused affix: pass 'affix' (an id from POST /v1/affixes)")
        raw = body.prompt
        texts = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
        if not texts or any(t == "" or t == [] for t in texts):
            raise BadRequest("prompt must not be empty")
        if body.stream and len(texts) > 1:
            raise BadRequest("stream=true takes a single prompt")
        def build() -> list[AffixPrompt]:
            built = [affixer.completion_prompt(t, affix_ids, name, body.affix_layout) for t in texts]
            if body.suffix:  # infilling: the suffix's tokens follow the generation region
                tail = tuple(llm.inputs.encode_text(body.suffix))
                built = [AffixPrompt(p.token_ids + tail, p.gen_at, p.affixes) for p in built]
            return built

        try:
            prompts = await asyncio.to_thread(build)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        for p in prompts:
            if body.logprobs is not None and p.gen_at != len(p.token_ids):
                raise BadRequest("logprobs need the generation region at the end of the prompt; affix_layout "
                                 "'suffix' puts the affix after it")
            if score_only:
                try:
                    p.check_fits(llm.config.vocab_size, llm.max_model_len, 0)
                except ValueError as exc:
                    raise BadRequest(str(exc)) from None
            else:
                prompt_fits(p, params)
        counters["requests_total"] += len(prompts)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            return StreamingResponse(stream_events(prompts[0], params, body, rid, created, chat=False),
                                     media_type="text/event-stream")
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        decoded = []
        for p in prompts:
            if score_only:
                decoded.append((None, Cut("", [], False), "length"))
            else:
                out = await until_disconnect(request, final_output(p, params))
                cut = final_text(out, body)
                decoded.append((out, cut, finish_reason(out, params, cut, body.max_tokens)))
        logprobs_list: list = [None] * len(prompts)
        if body.logprobs is not None:  # every prompt of the request in one scoring pass
            logprobs_list = await scoring(request, scorer.completions,
                                          [(p.token_ids, scored_tokens(out, cut, body.max_tokens))
                                           for p, (out, cut, _) in zip(prompts, decoded, strict=True)],
                                          bool(body.echo), body.logprobs, body.seed, body.mc_samples)
        for i, (p, (_, cut, finish), logprobs) in enumerate(zip(prompts, decoded, logprobs_list, strict=True)):
            echoed = ""
            if body.echo:  # the whole prompt, a registered affix included, as its logprobs cover it
                echoed = llm.tokenizer.decode(p.token_ids) if affix_ids is not None or not isinstance(texts[i], str) \
                    else texts[i]
            choices.append({"index": i, "text": echoed + cut.text, "logprobs": logprobs, "token_ids": cut.token_ids,
                            "finish_reason": finish})
            usage["prompt_tokens"] += len(p.token_ids)
            usage["completion_tokens"] += len(cut.token_ids)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body)
        messages = [m.as_dict() for m in body.messages]
        registered_count, registered_key = 0, None
        if body.affix is not None:
            try:
                registered_ids, registered, _ = registry.get(body.affix)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            if registered is None:
                raise BadRequest(f"affix {body.affix!r} was registered as text; chat requests take affixes "
                                 "registered as messages")
            messages = registered + messages
            registered_count, registered_key = len(registered), affix_key(registered_ids)
        if body.top_logprobs and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true")
        if body.mc_samples is not None and not body.logprobs:
            raise BadRequest("mc_samples sets the Monte Carlo draws of logprobs: pass logprobs=true too")
        scoring_allowed(bool(body.logprobs))
        if body.logprobs and body.stream:
            raise BadRequest("logprobs are estimated once decoding ends: use stream=false")
        reuse = body.selector != "off" and body.affix_reuse != "off"
        if llm.engine.state_cache:  # its cache is built per request: the system prompt is computed like the rest
            if body.selector not in (None, "off") or body.affix_reuse == "always":
                raise BadRequest(f"{'selector' if body.selector not in (None, 'off') else 'affix_reuse'} applies "
                                 f"to a reused affix, which the {llm.model.family} family does not support")
            reuse = False
        try:
            candidate = await asyncio.to_thread(affixer.chat_prompt, messages, reuse, registered_count)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        reuse_params = sampling_params(body, reuse=bool(candidate.affixes), default_selector=llm.default_selector)
        automatic = tuple(a.key for a in candidate.affixes if a.key != registered_key)
        plan = None
        if automatic and body.affix_reuse != "always":
            deterministic = reuse_params.temperature == 0 or reuse_params.seed is not None
            plan = gate.plan(automatic, reuse_params, deterministic, bool(body.logprobs))
        prompt, params, check = candidate, reuse_params, None
        if plan is not None and plan.decision is not Decision.REUSE:
            prompt = AffixPrompt(candidate.token_ids, candidate.gen_at,
                                 tuple(a for a in candidate.affixes if a.key == registered_key))
            params = sampling_params(body, reuse=bool(prompt.affixes), default_selector=llm.default_selector)
            if plan.decision is Decision.CHECK:
                check = Check(candidate, reuse_params, plan.key)
                try:
                    prompt_fits(candidate, reuse_params)
                except BadRequest as exc:  # the request runs as it is; only its check cannot
                    gate.drop(plan.key)
                    check, plan = None, Plan(Decision.RECOMPUTE, plan.key, f"not checked: with reuse, {exc}")
        prompt_fits(prompt, params)
        counters["requests_total"] += 1
        if plan is not None:
            counters[f"auto_reuse_{plan.decision.value}_total"] += 1
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        reuse_report = functools.partial(reuse_usage, prompt, params, plan, registered_key, bool(body.logprobs))
        if body.stream:
            return StreamingResponse(stream_events(prompt, params, body, rid, created, chat=True, check=check,
                                                   report=reuse_report), media_type="text/event-stream")
        out = await until_disconnect(request, final_output(prompt, params, check))
        cut = final_text(out, body)
        logprobs = None
        if body.logprobs:
            logprobs = await scoring(request, scorer.chat, prompt.token_ids, cut.token_ids, body.top_logprobs or 0,
                                     body.seed, body.mc_samples)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": cut.text},
                             "logprobs": logprobs, "finish_reason": finish_reason(out, params, cut, body.max_tokens),
                             "token_ids": cut.token_ids}],
                "usage": {"prompt_tokens": len(prompt.token_ids), "completion_tokens": len(cut.token_ids),
                          "total_tokens": len(prompt.token_ids) + len(cut.token_ids), **reuse_report(out)}}

    def reuse_usage(prompt: AffixPrompt, params: SamplingParams, plan: Plan | None, registered_key: str | None,
                    logprobs: bool, out) -> dict:
        """What the answer reused, and why: OpenAI's ``prompt_tokens_details.cached_tokens`` (prompt tokens
        whose K/V came from a shared copy, anchors not counted) and acache's ``affix_reuse``."""
        reused = out.affix_tokens if out is not None else 0
        anchors = len(out.anchors) if out is not None else 0
        report = {"decision": (plan.decision.value if plan is not None else
                               Decision.REUSE.value if prompt.affixes else "none"),
                  "reason": plan.reason if plan is not None else ("a registered affix" if prompt.affixes else
                                                                  "no span of this prompt was seen before"),
                  "reused_tokens": reused, "anchor_tokens": anchors,
                  "selector": params.affix_policy if prompt.affixes else None,
                  "anchor_ratio": params.anchor_ratio if prompt.affixes else None,
                  "spans": [{"tokens": a.length, "kind": "registered" if a.key == registered_key else "automatic"}
                            for a in prompt.affixes]}
        if plan is not None:
            report["state"] = gate.state(plan.key)
        if logprobs:
            report["logprobs"] = ("estimated over the full context without reuse" + (
                "; the tokens were decoded with reuse" if prompt.affixes else ", as the tokens were decoded"))
        return {"prompt_tokens_details": {"cached_tokens": max(0, reused - anchors)}, "affix_reuse": report}

    def scoring_allowed(wanted: bool) -> None:
        """Scoring runs the model outside the engine, which tensor-parallel ranks do not mirror; it masks and
        scores whole sequences bidirectionally, which a scan family's cache interface does not offer."""
        if wanted and llm.tensor_parallel_size > 1:
            raise BadRequest("logprobs are not supported with --tensor-parallel-size > 1 yet")
        if wanted and llm.engine.state_cache:
            raise BadRequest(f"logprobs are not supported for the {llm.model.family} family yet")

    async def scoring(request: Request, fn: Callable, *args):
        """Runs a scoring job on the scoring thread; a client that goes away stops it between two batches."""
        cancel = threading.Event()
        drain.track(cancel)
        future = asyncio.get_running_loop().run_in_executor(score_pool, functools.partial(fn, *args, cancel=cancel))
        try:
            return await until_disconnect(request, future)
        except ScoringCancelled:
            if drain.expired is not None:
                raise drain.expired from None
            raise
        finally:
            cancel.set()  # a no-op once the job is done
            drain.untrack(cancel)

    def final_text(out, body: DiffusionFields) -> Cut:
        ids = out.token_ids[:body.max_tokens] if body.max_tokens is not None else out.token_ids
        return cut_at_stop(ids, llm.tokenizer.decode, stop_list(body.stop))

    async def final_output(prompt: AffixPrompt, params: SamplingParams, check: Check | None = None):
        shadow = start_check(check)
        plain = None
        try:
            outputs = [o async for o in engine.generate(prompt, params, stream=False)]
            plain = outputs[-1]
        except (RequestFailed, EngineFailed) as exc:
            raise RequestError(str(exc)) from None
        finally:
            settle_check(shadow, check, plain)
        return plain

    def start_check(check: Check | None) -> asyncio.Task | None:
        """Runs the checked request with reuse beside the answer without it (the client never sees it)."""
        if check is None:
            return None
        task = asyncio.ensure_future(final_output(check.prompt, check.params))
        checks_running.add(task)
        task.add_done_callback(checks_running.discard)
        return task

    def settle_check(shadow: asyncio.Task | None, check: Check | None, plain) -> None:
        """Records whether reuse gave the answer ``plain`` once the shadow request ends; without an answer
        (the client went away, the request failed) the check is dropped."""
        if shadow is None:
            return
        if plain is None:
            shadow.cancel()
            gate.drop(check.key)
            return
        want = list(plain.token_ids)

        def compare(task: asyncio.Task) -> None:
            if task.cancelled() or task.exception() is not None:
                gate.drop(check.key)
            else:
                same = list(task.result().token_ids) == want
                gate.record(check.key, same)
                if not same:
                    log.warning("automatic reuse changed an answer: its spans are recomputed from now on (%s)",
                                check.key[1:])

        shadow.add_done_callback(compare)

    async def stream_events(prompt: AffixPrompt, params: SamplingParams, body: DiffusionFields, rid: str,
                            created: int, chat: bool, check: Check | None = None,
                            report: Callable | None = None) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        sent = ""
        final = None

        def event(delta_text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else (
                    {"content": delta_text} if delta_text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model_name,
                                          "choices": [choice]}) + "\n\n"

        if chat:
            yield event(None, None, first=True)
        stops = stop_list(body.stop)
        shadow = start_check(check)
        try:
            async for out in engine.generate(prompt, params, stream=True):
                cut = final_text(out, body)
                if out.finished or cut.stopped:  # a stop string ends the stream at once
                    final = out if out.finished else None
                    yield event(cut.text[len(sent):], finish_reason(out, params, cut, body.max_tokens))
                    if (body.stream_options or {}).get("include_usage"):
                        n, m = len(prompt.token_ids), len(cut.token_ids)
                        extra = report(out) if report is not None else {}
                        yield "data: " + json.dumps({"id": rid, "object": kind, "created": created,
                                                     "model": model_name, "choices": [], "usage": {
                                                         "prompt_tokens": n, "completion_tokens": m,
                                                         "total_tokens": n + m, **extra}}) + "\n\n"
                    break
                safe = cut.text[:len(cut.text) - held_back(cut.text, stops)]
                if len(safe) > len(sent):
                    yield event(safe[len(sent):], None)
                    sent = safe
        except Exception as exc:  # after the first event the status is sent: report in the stream
            known = (RequestFailed, EngineFailed, ValueError, ShuttingDown)
            message = str(exc) if isinstance(exc, known) else "internal error while streaming"
            yield "data: " + json.dumps(error_body(message, "server_error")) + "\n\n"
        finally:
            settle_check(shadow, check, final)  # a stream cut by a stop string is not compared
        yield "data: [DONE]\n\n"

    return app


async def until_disconnect(request: Request, work):
    """Awaits ``work``; a client that disconnects first cancels it, which aborts its engine request."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if not done and await request.is_disconnected():
                task.cancel()
                raise ClientGone()
        return task.result()
    finally:
        if not task.done():
            task.cancel()


class Check(NamedTuple):
    """The same request with automatic reuse, run beside its answer without it to see if reuse changes it."""

    prompt: AffixPrompt
    params: SamplingParams
    key: tuple


class ClientGone(Exception):
    """The client went away before its answer was ready."""


def leading_affix_ids(inputs: InputProcessor, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered as the start of a conversation (what a chat will reuse)."""
    prompt = inputs.chat_prompt(messages + [{"role": "user", "content": ""}], affix_messages=range(len(messages)))
    return list(prompt.affix_ids(prompt.affixes[0]))


def scored_tokens(out, cut: Cut, max_tokens: int | None) -> list[int]:
    """The generated tokens logprobs cover: the text's, plus the stop token that ended it (as OpenAI-style
    servers report it, and as lm-eval expects: one entry per generated token, even when it is the EOS)."""
    ids = list(cut.token_ids)
    if out is not None and out.stopped and not cut.stopped and len(ids) < (max_tokens or len(ids) + 1):
        ids.append(out.stop_token_id)
    return ids


def finish_reason(out, params: SamplingParams, cut: Cut, max_tokens: int | None = None) -> str:
    """``stop`` when a stop token or stop string ended the text, ``length`` when the budget did."""
    limit = min(params.gen_length, max_tokens or params.gen_length)
    if cut.stopped:
        return "stop"
    return "stop" if out.stopped and len(out.token_ids) < limit else "length"
