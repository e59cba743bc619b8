"""``POST /v1/completions``: one or several prompts, a registered affix in any layout, infilling, streaming,
and scoring (``echo`` with ``logprobs``, ``max_tokens=0`` to score the prompt alone)."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from acache.affix.prompt import AffixPrompt
from acache.sampling_params import SamplingParams
from acache.server.logprobs import ScoringRefused
from acache.server.protocol import BadRequest, CompletionRequest
from acache.server.serving import OpenAIServing, RequestError, finish_reason, until_disconnect
from acache.server.stops import Cut


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint: every check before any work, then each prompt decoded, then every prompt of
    the request scored in one pass."""

    def check(self, body: CompletionRequest) -> None:
        """The refusals that concern the request's fields together, before its prompts are built."""
        if body.max_tokens == 0 and not body.echo:
            raise BadRequest("max_tokens=0 generates nothing: it is allowed only with echo=true, which returns the "
                             "prompt (scored, with logprobs)")
        if body.max_tokens == 0 and body.stream:
            raise BadRequest("max_tokens=0 generates nothing to stream: use stream=false")
        if body.mc_samples is not None and body.logprobs is None:
            raise BadRequest("mc_samples sets the Monte Carlo draws of logprobs: pass logprobs too")
        self.scoring_allowed(body.logprobs is not None)
        if body.logprobs is not None and body.stream:
            raise BadRequest("logprobs are estimated once decoding ends: use stream=false")
        if body.echo and body.stream:
            raise BadRequest("echo returns the prompt with the whole completion: use stream=false")
        if body.logprobs is not None and body.suffix:
            raise BadRequest("logprobs with suffix (infilling) are not implemented: the generated tokens must end "
                             "the sequence")

    async def create(self, body: CompletionRequest, request: Request):
        self.check_model(body)
        llm, ctx = self.llm, self.ctx
        affix_ids, name = None, None
        if body.affix is not None:
            try:
                affix_ids, _, name = ctx.registry.get(body.affix)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        score_only = body.max_tokens == 0
        self.check(body)
        # a registered affix is reused from its first use (auto and always alike) unless the request turns reuse off
        reuse = self.reuse_allowed(body, affix_ids is not None and body.affix_reuse != "off", affix_ids is not None)
        params = (body.model_copy(update={"max_tokens": None}) if score_only else body).to_sampling_params(
            reuse=reuse, default_selector=llm.default_selector)
        if body.selector not in (None, "off") and affix_ids is None:
            raise BadRequest("selector applies to a reused affix: pass 'affix' (an id from POST /v1/affixes)")
        for field in ("probe_step", "anchor_query", "anchor_pass", "anchor_depth"):
            if getattr(body, field) and affix_ids is None:
                raise BadRequest(f"{field} applies to a reused affix: pass 'affix' (an id from POST /v1/affixes)")
        raw = body.prompt
        texts = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
        if not texts or any(t == "" or t == [] for t in texts):
            raise BadRequest("prompt must not be empty")
        if body.stream and len(texts) > 1:
            raise BadRequest("stream=true takes a single prompt")

        def build() -> list[AffixPrompt]:
            built = [ctx.affixer.completion_prompt(t, affix_ids, name, body.affix_layout) for t in texts]
            if body.suffix:  # infilling: the suffix's tokens follow the generation region
                tail = tuple(llm.inputs.encode_text(body.suffix))
                built = [AffixPrompt(p.token_ids + tail, p.gen_at, p.affixes) for p in built]
            return built

        try:
            prompts = await asyncio.to_thread(build)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if not score_only:
            params = self.fit_to_context(max(len(p.token_ids) for p in prompts), params, body)
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
                self.prompt_fits(p, params)
        if body.logprobs is not None and not score_only:  # refused before decoding, not after it
            try:
                ctx.scorer.check_prompts([p.token_ids for p in prompts], bool(body.echo), body.logprobs,
                                         body.mc_samples, params.gen_length)
            except ScoringRefused as exc:
                raise BadRequest(str(exc)) from None
        ctx.counters["requests_total"] += len(prompts)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        reused = affix_ids is not None and not score_only
        if body.stream:
            report = (functools.partial(self.reuse_usage, prompts[0], params, None, body.affix, False) if reused
                      else None)
            return StreamingResponse(self.stream_events(prompts[0], params, body, rid, created, chat=False,
                                                        report=report),
                                     media_type="text/event-stream")
        if score_only:
            decoded = [(None, Cut("", [], False), "length") for _ in prompts]
        else:
            decoded = await until_disconnect(request, self.decode_all(prompts, params, body))
        echoes = [""] * len(prompts)
        if body.echo:  # the prompt before the generation region, a registered affix included, as logprobs cover it
            echoes = [llm.tokenizer.decode(p.token_ids[:p.gen_at]) if affix_ids is not None or not isinstance(text, str)
                      else text
                      for p, text in zip(prompts, texts, strict=True)]
        logprobs_list: list = [None] * len(prompts)
        if body.logprobs is not None:  # every prompt of the request in one scoring pass
            logprobs_list = await self.scoring(request, ctx.scorer.completions,
                                               [(p.token_ids, scored_tokens(out, cut, body.max_tokens), echoed,
                                                 cut.text)
                                                for p, (out, cut, _), echoed in zip(prompts, decoded, echoes,
                                                                                    strict=True)],
                                               bool(body.echo), body.logprobs, body.seed, body.mc_samples)
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        for i, (p, (_, cut, finish), logprobs) in enumerate(zip(prompts, decoded, logprobs_list, strict=True)):
            echoed = echoes[i]
            choices.append({"index": i, "text": echoed + cut.text, "logprobs": logprobs, "token_ids": cut.token_ids,
                            "finish_reason": finish})
            usage["prompt_tokens"] += len(p.token_ids)
            usage["completion_tokens"] += len(cut.token_ids)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if reused:
            usage |= summed_reuse([self.reuse_usage(p, params, None, body.affix, body.logprobs is not None, out)
                                   for p, (out, _, _) in zip(prompts, decoded, strict=True)])
        return {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                "choices": choices, "usage": usage}

    async def decode_all(self, prompts: list[AffixPrompt], params: SamplingParams,
                         body: CompletionRequest) -> list[tuple]:
        """Every prompt of one request decoded at once, so that they share the engine's batches (one after the other
        they took as many times as long); each as ``(output, cut text, finish reason)``. One that fails stops the
        others."""
        async def one(prompt: AffixPrompt) -> tuple:
            out = await self.final_output(prompt, params)
            cut = self.final_text(out, body)
            return out, cut, finish_reason(out, params, cut, body.max_tokens)

        return await _first_failure_cancels_the_rest([asyncio.ensure_future(one(p)) for p in prompts])


async def _first_failure_cancels_the_rest(tasks: list[asyncio.Task]) -> list:
    """The tasks' results in order; the first to fail (in order, among those failed) is raised and the others are
    cancelled, as they are when the caller is (Python 3.10 has no TaskGroup)."""
    for task in tasks:  # every failure is read here or below (never "Task exception was never retrieved")
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                if task.done() and task.cancelled():  # by something else than this request: it cannot answer
                    raise RequestError("a prompt of this request was cancelled")
                if task.done() and task.exception() is not None:
                    raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


def scored_tokens(out, cut: Cut, max_tokens: int | None) -> list[int]:
    """The generated tokens logprobs cover: the text's, plus the stop token that ended it (as OpenAI-style
    servers report it, and as lm-eval expects: one entry per generated token, even when it is the EOS)."""
    ids = list(cut.token_ids)
    if out is not None and out.stopped and not cut.stopped and len(ids) < (max_tokens or len(ids) + 1):
        ids.append(out.stop_token_id)
    return ids


def summed_reuse(reports: list[dict]) -> dict:
    """One usage report for several prompts on one registered affix: their token counts summed, the rest (the
    same for every prompt of the request) as the first reports it."""
    total = reports[0]["affix_reuse"] | {key: sum(r["affix_reuse"][key] for r in reports)
                                         for key in ("reused_tokens", "anchor_tokens")}
    cached = sum(r["prompt_tokens_details"]["cached_tokens"] for r in reports)
    return {"prompt_tokens_details": {"cached_tokens": cached}, "affix_reuse": total}
