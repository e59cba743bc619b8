"""What every OpenAI-style handler shares: the served model and its engine, decoding a request to its final
output or to a stream of events, the shadow check of automatic reuse, and scoring on threads of its own.

The handlers themselves are one class a route family (``serving_completion``, ``serving_chat``,
``serving_affixes``, ``serving_tokenization``); ``app.py`` keeps the routes and the mapping of errors to statuses.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from acache.affix.prompt import AffixPrompt
from acache.llm import LLM
from acache.models.config import affix_training
from acache.sampling_params import SamplingParams
from acache.scoring import ScoringCancelled
from acache.server.affix_reuse import AffixRegistry, AutoAffixer
from acache.server.async_engine import AsyncEngine, EngineFailed, RequestFailed
from acache.server.logprobs import Scorer, ScoringRefused
from acache.server.protocol import BadRequest, DiffusionFields, ModelNotFound, error_body
from acache.server.reuse_gate import Decision, Plan, ReuseGate
from acache.server.shutdown import Drain, ShuttingDown
from acache.server.stops import Cut, cut_at_stop, held_back, spelled, stop_list

log = logging.getLogger("acache.server")


class RequestError(RuntimeError):
    """A request the engine failed alone: 500 with the engine's message, the server goes on."""


class ClientGone(Exception):
    """The client went away before its answer was ready."""


@dataclass
class Check:
    """The same request with automatic reuse, run beside its answer without it to see if reuse changes it;
    ``started`` once it runs (a check planned for a stream its client left before it began never does). The two
    answers are compared on the whole region the engine decoded (every token up to the first stop token), not on
    what this client is sent: trust is shared by every request of the same spans and decoding, whatever its
    ``max_tokens`` or stop strings, so a match on part of an answer does not vouch for the whole. A stream a stop
    string ended decodes on in the background for its check (``OpenAIServing.stream_events``); where an answer
    without reuse still was not decoded whole (that decoding failed, or the server stopped), the tokens the client
    was sent (the first ``limit``, cut at the first of ``stops``) can only show a mismatch: a match there is no
    evidence."""

    prompt: AffixPrompt
    params: SamplingParams
    key: tuple
    request: Hashable = None
    limit: int | None = None
    stops: tuple[str, ...] = ()
    started: bool = False

    def sent(self, token_ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[int]:
        """The tokens of an answer a client is sent (decoded only where a stop string may cut them)."""
        kept = list(token_ids[:self.limit])
        return cut_at_stop(kept, decode, list(self.stops)).token_ids if self.stops else kept

    def abandon(self, gate: ReuseGate) -> None:
        """Tells the gate that a check planned never ran, or ended without an answer to compare."""
        gate.drop(self.key, self.request)


class CheckedStream(StreamingResponse):
    """The events of a request with a planned check: a stream that never began (its client gone before its
    first byte, so its events never ran) drops the check with the gate, which would otherwise count it as running
    for good; a stream that began settles it itself."""

    def __init__(self, events: AsyncIterator[str], check: Check, gate: ReuseGate) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.check, self.gate = check, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # one left at a send that failed settles its check now, not at GC
            if not self.check.started:
                self.check.abandon(self.gate)


@dataclass
class ServerContext:
    """The served model and the server's shared parts, built once by ``create_app`` and handed to each
    handler class."""

    llm: LLM
    model_name: str
    engine: AsyncEngine
    drain: Drain
    scorer: Scorer
    score_pool: ThreadPoolExecutor
    registry: AffixRegistry
    affixer: AutoAffixer
    gate: ReuseGate
    counters: Counter = field(default_factory=Counter)
    #: shadow checks in flight, held here: the event loop keeps only weak references to tasks
    checks_running: set = field(default_factory=set)


class OpenAIServing:
    """The base of the handler classes: the checks every request makes, and decoding one request."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.llm = ctx.llm

    def model_card(self) -> dict:
        """OpenAI's model object, plus how this model's affixes are reused by default and why."""
        llm = self.llm
        trained = affix_training(llm.config) is not None
        return {"id": self.ctx.model_name, "object": "model", "created": 0, "owned_by": "acache",
                "max_model_len": llm.max_model_len,
                "affix_reuse": {"default_selector": llm.default_selector, "affix_trained": trained,
                                "mode": "direct reuse (trained to be reused)" if trained else
                                f"ACache: anchors chosen by {llm.default_selector}"}}

    def check_model(self, body) -> None:
        if body.model is not None and body.model != self.ctx.model_name:
            raise ModelNotFound(f"model {body.model!r} is not served here; this server serves {self.ctx.model_name!r}")

    def fit_to_context(self, prompt_tokens: int, params: SamplingParams, body: DiffusionFields) -> SamplingParams:
        """``max_tokens`` becomes whole blocks (``to_sampling_params``); where those pass the context but
        ``max_tokens`` itself fits beside a ``prompt_tokens`` prompt, the blocks are those nearest the default length
        (the shorter on a tie) whose whole number covering ``max_tokens`` still fits, and that ``steps`` divides when
        given: 37 tokens with room for 37 are one block of 37, not 37 of one (the client chose neither length; the
        answer is cut to ``max_tokens`` all the same). Such a request near the context's end was refused, naming a
        gen_length it never sent. Where no block fits, the params are left as they are, and the request is refused
        naming them."""
        limit, room = body.token_limit, self.llm.max_model_len - prompt_tokens
        if (limit is None or body.gen_length is not None or body.block_length is not None
                or params.gen_length <= room or limit > room):
            return params

        def fits(block: int) -> bool:
            gen = -(-limit // block) * block
            return gen <= room and (params.steps is None or params.steps % (gen // block) == 0)

        blocks = [b for b in range(1, limit + 1) if fits(b)]
        if not blocks:
            return params
        block = min(blocks, key=lambda b: (abs(b - params.block_length), b))
        return replace(params, gen_length=-(-limit // block) * block, block_length=block)

    def prompt_fits(self, prompt: AffixPrompt, params: SamplingParams) -> None:
        """Every check the engine makes when a request is added (context, vocabulary, pool size, BiCache
        profile), made before any work or any streamed byte."""
        try:
            self.llm.engine.check_request(prompt, params)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    def reuse_usage(self, prompt: AffixPrompt, params: SamplingParams, plan: Plan | None, registered_key: str | None,
                    logprobs: bool, out) -> dict:
        """What the answer reused, and why: OpenAI's ``prompt_tokens_details.cached_tokens`` (prompt tokens
        whose K/V came from a shared copy, anchors and the affix columns recomputed beside the request's own not
        counted) and acache's ``affix_reuse``."""
        reused = out.affix_tokens if out is not None else 0
        anchors = len(out.anchors) if out is not None else 0
        cached = out.cached_tokens if out is not None else 0
        reuse = params.affix_reuse(bool(prompt.affixes))[0]  # a registered affix with selector 'off' is not reused
        if plan is not None:
            reason = plan.reason
        elif reuse:
            reason = "a registered affix"
        elif not prompt.affixes:
            reason = "no span of this prompt was seen before"
        elif self.llm.engine.state_cache:
            reason = f"the {self.llm.model.family} family computes affixes with the request"
        else:
            reason = "reuse off (selector or affix_reuse 'off'): the affix computed with the request"
        decision = plan.decision.value if plan is not None else Decision.REUSE.value if reuse else "none"
        report = {"decision": decision,
                  "reason": reason,
                  "reused_tokens": reused, "anchor_tokens": anchors,
                  "selector": params.selector if reuse else None,
                  "anchor_ratio": params.anchor_ratio if reuse else None,
                  "spans": [{"tokens": a.length, "kind": "registered" if registered_key is not None and i == 0
                             else "automatic"} for i, a in enumerate(prompt.affixes)]}
        if plan is not None:
            report["state"] = self.ctx.gate.state(plan.key)
        if logprobs:
            report["logprobs"] = ("estimated over the full context without reuse" + (
                "; the tokens were decoded with reuse" if decision == Decision.REUSE.value else
                ", as the tokens were decoded"))
        return {"prompt_tokens_details": {"cached_tokens": cached}, "affix_reuse": report}

    def encode_text(self, text: str) -> list[int]:
        try:
            return self.llm.inputs.encode_text(text)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    def reuse_allowed(self, body: DiffusionFields, reuse: bool, affix_given: bool) -> bool:
        """``reuse``, or False for a state-cache family, whose cache is built per request (an affix is computed
        with the prompt); a request that asks for reuse there by name (a selector, or ``affix_reuse`` 'always' where
        there is an affix to reuse) is refused."""
        if not self.llm.engine.state_cache:
            return reuse
        if body.selector not in (None, "off") or (body.affix_reuse == "always" and affix_given):
            raise BadRequest(f"{'selector' if body.selector not in (None, 'off') else 'affix_reuse'} applies to a "
                             f"reused affix, which the {self.llm.model.family} family does not support")
        return False

    def scoring_allowed(self, wanted: bool) -> None:
        """Scoring runs the model outside the engine, which tensor-parallel ranks do not mirror; it masks and
        scores whole sequences bidirectionally, which a state-cache family's cache interface does not offer."""
        if wanted and self.llm.tensor_parallel_size > 1:
            raise BadRequest("logprobs are not supported with --tensor-parallel-size > 1 yet")
        if wanted and self.llm.engine.state_cache:
            raise BadRequest(f"logprobs are not supported for the {self.llm.model.family} family yet")

    async def scoring(self, request: Request, fn: Callable, *args):
        """Runs a scoring job on the scoring threads; a client that goes away stops it between two batches."""
        drain = self.ctx.drain
        cancel = threading.Event()
        drain.track(cancel)
        future = asyncio.get_running_loop().run_in_executor(self.ctx.score_pool,
                                                            functools.partial(fn, *args, cancel=cancel))
        try:
            return await until_disconnect(request, future)
        except ScoringRefused as exc:
            raise BadRequest(str(exc)) from None
        except ScoringCancelled:
            if drain.expired is not None:
                raise drain.expired from None
            raise
        finally:
            cancel.set()  # a no-op once the job is done
            drain.untrack(cancel)

    def final_text(self, out, body: DiffusionFields) -> Cut:
        limit = body.token_limit
        ids = out.token_ids[:limit] if limit is not None else out.token_ids
        return cut_at_stop(ids, self.llm.tokenizer.decode, stop_list(body.stop))

    async def final_output(self, prompt: AffixPrompt, params: SamplingParams, check: Check | None = None):
        shadow = self.start_check(check)
        plain = None
        try:
            outputs = [o async for o in self.ctx.engine.generate(prompt, params, stream=False)]
            plain = outputs[-1]
        except (RequestFailed, EngineFailed) as exc:
            raise RequestError(str(exc)) from None
        finally:
            self.settle_check(shadow, check, plain)
        return plain

    def start_check(self, check: Check | None) -> asyncio.Task | None:
        """Runs the checked request with reuse beside the answer without it (the client never sees it)."""
        if check is None:
            return None
        check.started = True
        task = asyncio.ensure_future(self.final_output(check.prompt, check.params))
        self.ctx.checks_running.add(task)
        task.add_done_callback(self.ctx.checks_running.discard)
        return task

    def settle_check(self, shadow: asyncio.Task | None, check: Check | None, plain) -> None:
        """Records whether reuse gave the answer ``plain`` once the shadow request ends; without an answer
        (the client went away, the request failed) the check is dropped."""
        if shadow is None:
            return
        gate = self.ctx.gate
        if plain is None:
            shadow.cancel()
            check.abandon(gate)
            return
        decode = self.llm.tokenizer.decode
        whole = plain.finished
        want = list(plain.token_ids) if whole else check.sent(plain.token_ids, decode)

        def compare(task: asyncio.Task) -> None:
            if task.cancelled() or task.exception() is not None:
                check.abandon(gate)
                return
            reused = task.result().token_ids
            same = (list(reused) if whole else check.sent(reused, decode)) == want
            if same and not whole:  # part of an answer matched: no evidence, and this request is not checked again
                gate.drop(check.key)
            else:
                gate.record(check.key, same)
                if not same:
                    log.warning("automatic reuse changed an answer: its spans are recomputed from now on under this "
                                "policy and decoding (%s)", check.key[1:])

        shadow.add_done_callback(compare)

    async def stream_events(self, prompt: AffixPrompt, params: SamplingParams, body: DiffusionFields, rid: str,
                            created: int, chat: bool, check: Check | None = None,
                            report: Callable | None = None) -> AsyncIterator[str]:
        """The server-sent events of one request: text deltas held back where a stop string may begin, each with
        the ``token_ids`` whose text it completes (together, the answer's ``token_ids`` as a whole response gives
        them), the finish, the usage when asked for, and an error event if the request fails after the first byte."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        model_name = self.ctx.model_name
        sent = ""
        sent_ids = 0
        final = None

        def event(delta_text: str | None, finish: str | None, first: bool = False,
                  token_ids: Sequence[int] = ()) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else (
                    {"content": delta_text} if delta_text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "token_ids": list(token_ids)}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish,
                          "token_ids": list(token_ids)}
            return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model_name,
                                          "choices": [choice]}) + "\n\n"

        stops = stop_list(body.stop)
        decode = self.llm.tokenizer.decode
        shadow = self.start_check(check)
        outputs = self.ctx.engine.generate(prompt, params, stream=True)
        handed_off = False
        try:
            if chat:  # inside: a client that leaves at this first event still has its check settled
                yield event(None, None, first=True)
            async for out in outputs:
                cut = self.final_text(out, body)
                if out.finished or cut.stopped:  # a stop string ends the stream at once
                    final = out  # cut by a stop string or not, what it sent is final
                    # a check compares whole answers: the request decodes on for it, after the client's answer
                    handed_off = shadow is not None and not out.finished
                    yield event(cut.text[len(sent):], finish_reason(out, params, cut, body.token_limit),
                                token_ids=cut.token_ids[sent_ids:])
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
                    spelt = spelled(cut.token_ids, decode, safe.rstrip(), sent_ids)  # spaces wait: a stop may drop them
                    yield event(safe[len(sent):], None, token_ids=cut.token_ids[sent_ids:spelt])
                    sent, sent_ids = safe, spelt
        except Exception as exc:  # after the first event the status is sent: report in the stream
            if not isinstance(exc, (RequestFailed, EngineFailed, ValueError, ShuttingDown)):
                log.exception("internal error while streaming %s", rid)
                exc = RuntimeError("internal error while streaming")
            code = "shutting_down" if isinstance(exc, ShuttingDown) else None  # as a 503 before the stream names it
            yield "data: " + json.dumps(error_body(str(exc), "server_error", code=code)) + "\n\n"
        finally:
            if handed_off and not (shadow.done() and (shadow.cancelled() or shadow.exception() is not None)):
                self.hand_off(outputs, shadow, check, final)
            else:
                await outputs.aclose()  # the engine request, unfinished (a client gone), is aborted now
                self.settle_check(shadow, check, final)
        yield "data: [DONE]\n\n"

    def hand_off(self, outputs: AsyncIterator, shadow: asyncio.Task, check: Check, cut) -> asyncio.Task:
        """Decodes a stream a stop string ended on to its end in a task the server holds
        (:meth:`_decode_on_for_check`). A task cancelled before its first step (a shutdown out of grace) runs none of
        its code: its check is then settled on what was sent (its engine request is aborted by the shutdown's
        ``cancel_all``)."""
        started: list[bool] = []  # set by the task's first step
        task = asyncio.ensure_future(self._decode_on_for_check(outputs, shadow, check, cut, started))
        self.ctx.checks_running.add(task)
        task.add_done_callback(self.ctx.checks_running.discard)
        task.add_done_callback(lambda _: started or self.settle_check(shadow, check, cut))
        return task

    async def _decode_on_for_check(self, outputs: AsyncIterator, shadow: asyncio.Task, check: Check, cut,
                                   started: list[bool]) -> None:
        """A stream a stop string ended, decoded on to its end in the background, so that its check compares the
        whole answer; if it cannot finish (a failure, a shutdown), the check compares what the client was sent."""
        started.append(True)
        final = cut
        try:
            async for out in outputs:
                final = out
        except Exception:  # the answer is sent: its check falls back to what it showed
            final = cut
        except BaseException:  # cancelled (a shutdown): the same, and the cancellation goes on
            final = cut
            raise
        finally:
            await outputs.aclose()
            self.settle_check(shadow, check, final)


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


def finish_reason(out, params: SamplingParams, cut: Cut, max_tokens: int | None = None) -> str:
    """``stop`` when a stop token or stop string ended the text, ``length`` when the budget did."""
    limit = min(params.gen_length, max_tokens or params.gen_length)
    if cut.stopped:
        return "stop"
    return "stop" if out.stopped and len(out.token_ids) < limit else "length"
