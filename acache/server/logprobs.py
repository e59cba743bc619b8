"""The ``logprobs`` objects of completions and chat, filled from :mod:`acache.scoring`.

Completions (legacy shape): ``tokens``, ``token_logprobs``, ``top_logprobs`` and ``text_offset``, one entry a
token. With ``echo`` the prompt's tokens come first (the first of them has no value, as in OpenAI's API), and
the values from any prompt token to the end of the prompt add up to the estimate of ``log p(that suffix of
the prompt | what precedes it)``; the generated tokens follow, whose values add up to the estimate of
``log p(generated | prompt)``. lm-eval's loglikelihood requests read exactly such sums. The prompt, its
continuation and every other prompt of the request are scored in one pass (:func:`acache.scoring.score_jobs`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from acache.models.base import DiffusionLM
from acache.models.tokenizer import Tokenizer
from acache.scoring import ScoreJob, ScoringCancelled, TokenLogprobs, score_jobs, scoring_work, validate

#: token positions one request's scoring may forward by default (``acache serve --max-scoring-tokens``):
#: about a 2,000-token prompt echoed with 32 draws a split
DEFAULT_SCORING_TOKENS = 1 << 26


class AllSet:
    """Set once every one of ``events`` is: a shared pass stops only when all its callers gave up."""

    def __init__(self, events: Sequence[threading.Event | None]) -> None:
        self.events = [e for e in events if e is not None]
        self.all = len(self.events) == len(events)

    def is_set(self) -> bool:
        return self.all and all(e.is_set() for e in self.events)


class _Waiting:
    def __init__(self, jobs: Sequence[ScoreJob], cancel: threading.Event | None) -> None:
        self.jobs, self.cancel = list(jobs), cancel
        self.done = False
        self.result: list[TokenLogprobs] | None = None
        self.error: BaseException | None = None


class SharedPasses:
    """Scores the jobs of concurrent callers in shared passes. A caller that finds no pass running runs one
    with every caller waiting at that moment, its own jobs included; callers arriving meanwhile wait and the
    next of them runs the next pass. Each job keeps its own generator, so its values are those it gets alone. A
    caller that gives up has the rest of its rows left out of the pass, which goes on for the others (it stopped
    only once every caller had given up); every caller hears at the pass's end."""

    def __init__(self, run: Callable[[list[ScoreJob], AllSet], list[TokenLogprobs]],
                 attach: Callable[[ScoreJob, threading.Event | None], ScoreJob] = lambda job, cancel: job) -> None:
        self.run, self.attach = run, attach  # ``attach`` gives a job its caller's cancel
        self.passes = 0
        self._waiting: list[_Waiting] = []
        self._running = False
        self._cv = threading.Condition()

    def __call__(self, jobs: Sequence[ScoreJob], cancel: threading.Event | None = None) -> list[TokenLogprobs]:
        me = _Waiting(jobs, cancel)
        batch: list[_Waiting] = []
        with self._cv:
            self._waiting.append(me)
            while self._running and not me.done:
                if cancel is not None and cancel.is_set():  # gave up: its thread is freed now
                    if me in self._waiting:  # still queued (else a running pass took it, and leaves its rows out)
                        self._waiting.remove(me)
                    raise ScoringCancelled("scoring was cancelled")
                self._cv.wait(timeout=0.1)
            if not me.done:
                batch, self._waiting = self._waiting, []
                for gone in [w for w in batch if w.cancel is not None and w.cancel.is_set()]:
                    gone.error, gone.done = ScoringCancelled("scoring was cancelled"), True  # no work for it
                batch = [w for w in batch if not w.done]
                self._running = bool(batch)
                self._cv.notify_all()  # those who gave up hear it now, not after the pass
        if batch:  # run here even when this caller gave up: the others wait on it
            self._run(batch)
        if me.error is not None:
            raise me.error
        return me.result

    def _run(self, batch: list[_Waiting]) -> None:
        try:
            # each job carries its caller's cancel: one that gives up has its rows left out, the others' go on
            jobs = [self.attach(job, w.cancel) for w in batch for job in w.jobs]
            results = self.run(jobs, AllSet([w.cancel for w in batch]))
            at = 0
            for w in batch:
                w.result, at = results[at:at + len(w.jobs)], at + len(w.jobs)
                if w.cancel is not None and w.cancel.is_set():
                    w.result, w.error = None, ScoringCancelled("scoring was cancelled")
        except BaseException as exc:  # every caller of the pass hears of it (a cancel, a bad sequence)
            for w in batch:
                w.error = exc
        finally:
            with self._cv:
                self.passes += 1
                for w in batch:
                    w.done = True
                self._running = False
                self._cv.notify_all()


class ScoringRefused(ValueError):
    """A request whose scoring is refused before any work: the message says why (a bad sequence, too much
    work for the server's ``max_tokens``)."""


class Scorer:
    """Scores token sequences with the served model; ``lock`` (the engine's) is held around each forward so
    scoring interleaves with the engine's steps instead of racing them, and a forward takes at most
    ``batch_tokens`` tokens (the engine's step cap). Concurrent requests share passes (:class:`SharedPasses`); a
    request is checked alone first, so one that cannot be scored, or whose scoring would forward more than
    ``max_tokens`` token positions, is refused without touching the others."""

    def __init__(self, model: DiffusionLM, tokenizer: Tokenizer, samples: int,
                 lock: contextlib.AbstractContextManager | None = None, max_tokens: int = DEFAULT_SCORING_TOKENS,
                 batch_tokens: int | None = None) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise ValueError(f"max_scoring_tokens must be a positive integer, got {max_tokens!r}")
        self.model, self.tokenizer, self.samples, self.lock = model, tokenizer, samples, lock
        self.max_tokens = max_tokens
        self.shared = SharedPasses(lambda jobs, cancel: score_jobs(self.model, jobs, lock=self.lock, cancel=cancel,
                                                                   batch_tokens=batch_tokens),
                                   lambda job, cancel: dataclasses.replace(job, cancel=cancel))

    def job(self, token_ids: Sequence[int], start: int, top_k: int, seed: int | None,
            samples: int | None) -> ScoreJob:
        """One sequence's scoring, its draws from a generator of its own seeded by ``seed`` (0 when None)."""
        generator = torch.Generator().manual_seed(seed if seed is not None else 0)
        return ScoreJob(token_ids, start, samples or self.samples, generator, top_k)

    def score(self, token_ids: Sequence[int], start: int, top_k: int, seed: int | None,
              samples: int | None, cancel: threading.Event | None = None) -> TokenLogprobs:
        return self.score_all([self.job(token_ids, start, top_k, seed, samples)], cancel)[0]

    def score_all(self, jobs: Sequence[ScoreJob], cancel: threading.Event | None = None) -> list[TokenLogprobs]:
        """Several jobs in one pass, with those of any request scoring at the same time: rows of sequences of
        one length share forwards."""
        self._refuse(jobs)
        return self.shared(jobs, cancel)

    def check_prompts(self, prompts: Sequence[Sequence[int]], echo: bool, top_k: int, samples: int | None,
                      gen_length: int = 0) -> None:
        """What a request's scoring would be refused for that its prompts alone show, checked before it decodes
        (it decoded first, then heard the 400): a token scoring cannot read (the mask token, one outside the
        vocabulary), and scoring past ``max_tokens``: the echoed prompts', and the answers' at their longest
        (``gen_length`` tokens after each prompt)."""
        checked = [self.job(ids, 1, top_k, None, samples) for ids in prompts if len(ids) > 1]
        answers = [self.job([*ids, *[ids[-1]] * gen_length], len(ids), top_k, None, samples)
                   for ids in prompts if ids and gen_length > 0]
        self._refuse(checked, work=[j for j in checked if echo] + answers)

    def _refuse(self, jobs: Sequence[ScoreJob], work: Sequence[ScoreJob] | None = None) -> None:
        """Raises :class:`ScoringRefused` for a job that cannot be scored, or for too much work in ``work`` (all
        of ``jobs`` by default)."""
        for job in jobs:
            try:
                validate(self.model, job)
            except ValueError as exc:
                raise ScoringRefused(str(exc)) from None
        work = jobs if work is None else work
        total = sum(scoring_work(job) for job in work)
        if total > self.max_tokens:
            longest = max(len(job.token_ids) for job in work)
            raise ScoringRefused(
                f"scoring this request forwards about {total:,} token positions ({longest} tokens, "
                f"{max(job.samples for job in work)} draws a split), more than this server's --max-scoring-tokens of "
                f"{self.max_tokens:,}: lower mc_samples, max_tokens or the prompt's length")

    def piece(self, token_id: int) -> str:
        """A token's own text, special tokens included (an EOS is reported as itself, not as nothing); a byte-level
        token that is part of one character, as OpenAI spells it: ``bytes:`` and its bytes (``bytes:\\xc3``), so
        that two such tokens never share a name."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            raw = self.tokenizer.token_bytes(token_id)
            try:
                raw.decode()
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text

    def completions(self, choices: Sequence[tuple[Sequence[int], Sequence[int], str, str]], echo: bool, top_k: int,
                    seed: int | None, samples: int | None, cancel: threading.Event | None = None) -> list[dict]:
        """:meth:`completion` for each ``(prompt_ids, generated, echoed text, generated text)`` of a request, every
        prompt and continuation scored in one pass (each job seeded as it is alone, so a choice's values do not
        depend on the others)."""
        jobs: list[ScoreJob] = []
        for prompt_ids, generated, *_ in choices:
            if echo and len(prompt_ids) > 1:
                jobs.append(self.job(prompt_ids, 1, top_k, seed, samples))
            if generated:
                jobs.append(self.job([*prompt_ids, *generated], len(prompt_ids), top_k, seed, samples))
        scored = iter(self.score_all(jobs, cancel))
        return [self._completion(*choice, echo, top_k, scored) for choice in choices]

    def _completion(self, prompt_ids: Sequence[int], generated: Sequence[int], prompt_text: str, generated_text: str,
                    echo: bool, top_k: int, scored: Iterator[TokenLogprobs]) -> dict:
        tokens: list[int] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        if echo:
            tokens += list(prompt_ids)
            values.append(None)
            tops.append(None)
            offsets += self.tokenizer.char_offsets(prompt_text, prompt_ids)
            if len(prompt_ids) > 1:
                prompt = next(scored)
                values += prompt.values
                tops += [self._named(t) for t in prompt.top]
        if generated:
            continuation = next(scored)
            tokens += list(generated)
            values += continuation.values
            tops += [self._named(t) for t in continuation.top]
            offsets += [len(prompt_text) + o for o in self.tokenizer.char_offsets(generated_text, generated)]
        return {"tokens": [self.piece(t) for t in tokens], "token_logprobs": values,
                "top_logprobs": tops if top_k else None, "text_offset": offsets}

    def chat(self, prompt_ids: Sequence[int], generated: Sequence[int], top_k: int, seed: int | None,
             samples: int | None, cancel: threading.Event | None = None) -> dict:
        """The chat ``logprobs`` object: one entry a generated token."""
        if not generated:
            return {"content": []}
        scored = self.score([*prompt_ids, *generated], len(prompt_ids), top_k, seed, samples, cancel)
        content = []
        for token, value, top in zip(generated, scored.values, scored.top, strict=True):
            piece = self.piece(token)
            content.append({"token": piece, "logprob": value, "bytes": list(self.tokenizer.token_bytes(token)),
                            "top_logprobs": [{"token": self.piece(t), "logprob": v,
                                              "bytes": list(self.tokenizer.token_bytes(t))} for t, v in top.items()]})
        return {"content": content}

    def _named(self, top: dict[int, float]) -> dict[str, float]:
        """Top tokens by their text, most likely first; two that spell the same text (byte pieces of one
        character) keep the likelier's value."""
        named: dict[str, float] = {}
        for t, v in sorted(top.items(), key=lambda item: -item[1]):
            named.setdefault(self.piece(t), v)
        return named
