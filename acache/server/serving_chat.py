"""``POST /v1/chat/completions``: a conversation, a registered affix of messages before it, and the spans the
server saw before reused as the reuse gate (:mod:`acache.server.reuse_gate`) allows."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from acache.affix.prompt import AffixPrompt, affix_key
from acache.sampling_params import SamplingParams
from acache.server.logprobs import ScoringRefused
from acache.server.protocol import BadRequest, ChatCompletionRequest
from acache.server.reuse_gate import Decision, Plan
from acache.server.serving import Check, CheckedStream, OpenAIServing, finish_reason, until_disconnect
from acache.server.stops import stop_list


class OpenAIServingChat(OpenAIServing):
    """The chat endpoint: the prompt with every span it could reuse, the gate's plan for the automatic ones,
    and the answer with (or, until the spans are trusted, without) reuse."""

    def check(self, body: ChatCompletionRequest) -> None:
        """The refusals that concern the request's fields together, before its prompt is built."""
        if body.top_logprobs and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true")
        if body.mc_samples is not None and not body.logprobs:
            raise BadRequest("mc_samples sets the Monte Carlo draws of logprobs: pass logprobs=true too")
        self.scoring_allowed(bool(body.logprobs))
        if body.logprobs and body.stream:
            raise BadRequest("logprobs are estimated once decoding ends: use stream=false")

    async def create(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body)
        llm, ctx = self.llm, self.ctx
        messages = [m.as_dict() for m in body.messages]
        registered_count, registered_key = 0, None
        if body.affix is not None:
            try:
                registered_ids, registered, _ = ctx.registry.get(body.affix)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            if registered is None:
                raise BadRequest(f"affix {body.affix!r} was registered as text; chat requests take affixes "
                                 "registered as messages")
            messages = registered + messages
            registered_count, registered_key = len(registered), affix_key(registered_ids)
        self.check(body)
        reuse = self.reuse_allowed(body, body.selector != "off" and body.affix_reuse != "off", True)

        def admissible(plain: AffixPrompt) -> None:
            """Every refusal the request can meet without automatic reuse, made before its spans count as seen."""
            params = self.fit_to_context(len(plain.token_ids), body.to_sampling_params(
                reuse=bool(plain.affixes), default_selector=llm.default_selector), body)
            self.refuse_unservable(plain, params, body)

        try:
            candidate = await asyncio.to_thread(ctx.affixer.chat_prompt, messages, reuse, registered_count,
                                                admissible)
        except ValueError as exc:  # a BadRequest of admissible's among them, its message kept
            raise BadRequest(str(exc)) from None
        reuse_params = body.to_sampling_params(reuse=bool(candidate.affixes), default_selector=llm.default_selector)
        reuse_params = self.fit_to_context(len(candidate.token_ids), reuse_params, body)
        prompt, params, plan, check = self.plan(body, candidate, reuse_params, registered_key)
        try:
            self.refuse_unservable(prompt, params, body)
        except BadRequest:
            if check is not None:  # the check planned never runs: the gate must not count it as running
                check.abandon(ctx.gate)
            raise
        ctx.counters["requests_total"] += 1
        if plan is not None:
            ctx.counters[f"auto_reuse_{plan.decision.value}_total"] += 1
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        reuse_report = functools.partial(self.reuse_usage, prompt, params, plan, registered_key, bool(body.logprobs))
        if body.stream:
            events = self.stream_events(prompt, params, body, rid, created, chat=True, check=check,
                                        report=reuse_report)
            if check is not None:
                return CheckedStream(events, check, ctx.gate)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            out = await until_disconnect(request, self.final_output(prompt, params, check))
        finally:
            if check is not None and not check.started:  # cancelled before it began: it never will
                check.abandon(ctx.gate)
        cut = self.final_text(out, body)
        logprobs = None
        if body.logprobs:
            logprobs = await self.scoring(request, ctx.scorer.chat, prompt.token_ids, cut.token_ids,
                                          body.top_logprobs or 0, body.seed, body.mc_samples)
        return {"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": cut.text},
                             "logprobs": logprobs,
                             "finish_reason": finish_reason(out, params, cut, body.token_limit),
                             "token_ids": cut.token_ids}],
                "usage": {"prompt_tokens": len(prompt.token_ids), "completion_tokens": len(cut.token_ids),
                          "total_tokens": len(prompt.token_ids) + len(cut.token_ids), **reuse_report(out)}}

    def refuse_unservable(self, prompt: AffixPrompt, params: SamplingParams, body: ChatCompletionRequest) -> None:
        """The engine's checks of a request, and the logprobs' where asked (refused before decoding, not after)."""
        self.prompt_fits(prompt, params)
        if body.logprobs:
            try:
                self.ctx.scorer.check_prompts([prompt.token_ids], False, body.top_logprobs or 0, body.mc_samples,
                                              params.gen_length)
            except ScoringRefused as exc:
                raise BadRequest(str(exc)) from None

    def plan(self, body: ChatCompletionRequest, candidate: AffixPrompt, reuse_params: SamplingParams,
             registered_key: str | None) -> tuple[AffixPrompt, SamplingParams, Plan | None, Check | None]:
        """What the request runs: the candidate prompt with every span it could reuse, or, where the gate does
        not trust the automatic spans yet, the prompt without them (and, when the gate asks, a check with
        them run beside it)."""
        # the registered affix is the first (a span of the same tokens later in the chat is an automatic one)
        first = 1 if registered_key is not None else 0
        automatic = tuple(a.key for a in candidate.affixes[first:])
        if not automatic or body.affix_reuse == "always":
            return candidate, reuse_params, None, None
        gate = self.ctx.gate
        deterministic = reuse_params.temperature == 0 or reuse_params.seed is not None
        # a check counts once a request: its prompt, and its seed where the seed changes what it decodes (sampling,
        # or anchors drawn at random); at temperature 0 another seed is the same request
        seeded = reuse_params.temperature > 0 or reuse_params.selector == "random"
        request = (candidate.token_ids, reuse_params.seed if seeded else None)
        plan = gate.plan(automatic, reuse_params, deterministic, bool(body.logprobs), hash(request))
        if plan.decision is Decision.REUSE:
            return candidate, reuse_params, plan, None
        prompt = AffixPrompt(candidate.token_ids, candidate.gen_at, candidate.affixes[:first])
        params = self.fit_to_context(len(candidate.token_ids), body.to_sampling_params(
            reuse=bool(prompt.affixes), default_selector=self.llm.default_selector), body)
        check = None
        if plan.decision is Decision.CHECK:
            check = Check(candidate, reuse_params, plan.key, plan.request, body.token_limit,
                          tuple(stop_list(body.stop)))
            try:
                self.prompt_fits(candidate, reuse_params)
            except BadRequest as exc:  # the request runs as it is; only its check cannot
                check.abandon(gate)
                check, plan = None, Plan(Decision.RECOMPUTE, plan.key, f"not checked: with reuse, {exc}")
        return prompt, params, plan, check
