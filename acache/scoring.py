"""Log-likelihoods of a diffusion LM, estimated as LLaDA's paper scores multiple-choice answers.

A masked diffusion model has no left-to-right factorisation, so ``log p(continuation | context)`` is
estimated by the bound LLaDA evaluates with (its Eq. 6, the lower-variance form): draw ``l`` uniformly from
``1..L`` (``L`` continuation tokens), mask ``l`` of them chosen uniformly without replacement, and score
``(L / l) * sum over the masked tokens of log p(token | context, the unmasked rest)``; the estimate ``E_c`` for
the split at ``c`` is the mean over ``samples`` such draws, independent of each other. Every draw comes from
the caller's ``torch.Generator``, so a seed fixes it.

An OpenAI client asking for ``echo`` + ``logprobs`` does not say where its context ends (lm-eval sends
context and continuation as one prompt and sums the per-token values after its own split). So per-token
values are built by telescoping: token ``c`` gets ``E_c - E_{c+1}``, and the values from any ``c`` to the end
add up to ``E_c`` exactly. One value alone is a difference of two estimates, not a probability (it can even
be positive); only such sums are meaningful.

**Draws coupled across splits.** Sample ``s`` of every split comes from one chain (:func:`_chained_draws`),
built from the last split back to the first: going from split ``c + 1`` (``L`` tokens) to ``c``, the draw
becomes "all ``L + 1`` tokens masked" with probability ``1 / (L + 1)``; otherwise it keeps its ``l``, and with
probability ``l / (L + 1)`` one of its masked tokens, chosen uniformly, is swapped for token ``c``. By
induction each split's draw has exactly the distribution above (``l`` uniform in ``1..L``, the masked set
uniform given ``l``), and the chains are independent, so each ``E_c`` is distributed exactly as with
independent draws per split; only the estimates of different splits are now correlated (positively, which
makes the telescoped differences less noisy). About half the steps leave the masked set unchanged, and a
masked set is forwarded once however many (split, sample) pairs drew it, so a request costs about
``samples x (prompt length) / 2`` sequence forwards instead of ``samples x (prompt length - 1)``. The draws of a
split depend only on the seed and the splits after it: scoring from an earlier start, or one split alone
(:func:`continuation_logprob`), gives that split the same draws.

**Block-causal models** (block diffusion) decode a block of their attention given the blocks before it, clean,
and never see the blocks after it. Their bound is each block's bound with the earlier blocks unmasked, summed
(:func:`block_spans`): every block draws its own chain (the last block first), the per-token values telescope
within a block, and the sums from a split on still give its estimate. The whole-sequence bound, which masks earlier
blocks' tokens as well, scores a canvas their decoding never reads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from acache.affix.context import compact_index
from acache.models.base import DiffusionLM

DEFAULT_SAMPLES = 32


@dataclass(frozen=True)
class TokenLogprobs:
    """Per-token values for ``token_ids[start:]`` (``values[i]`` belongs to ``token_ids[start + i]``) and the
    ``top`` most likely tokens at each of those positions with the tokens after it masked. Where the position's own
    token is the most likely there (the token greedy decoding of that row gives), its entry in ``top`` is its value,
    as a token's own entry is its logprob in OpenAI's lists: a client that reads greediness as "the token's value is
    the highest of its top tokens" (lm-eval's ``is_greedy``, which asks for one top token) then reads it right,
    which a row's log-probability beside a telescoped value never did. With more top tokens it can read a greedy
    token as not greedy (another token's log-probability above the token's value), never the reverse."""

    token_ids: list[int]
    start: int
    values: list[float]
    top: list[dict[int, float]]


@dataclass(frozen=True)
class ScoreJob:
    """One sequence to score (:func:`score_jobs`): telescoped values for ``token_ids[start:]`` from ``samples``
    draws a split taken from ``generator``, and the ``top_k`` most likely tokens at each of those positions."""

    token_ids: Sequence[int]
    start: int
    samples: int
    generator: torch.Generator
    top_k: int = 0
    #: this job's caller gave up: its rows are left out of the forwards still to come (the others' go on)
    cancel: threading.Event | None = None


class ScoringCancelled(RuntimeError):
    """The caller gave up (``cancel`` was set): scoring stopped between two batches."""


def _check(model: DiffusionLM, ids: Sequence[int], starts: Sequence[int], samples: int) -> None:
    if isinstance(samples, bool) or not isinstance(samples, int) or samples <= 0:
        raise ValueError(f"samples must be a positive integer, got {samples!r}")
    if len(starts) == 0:
        raise ValueError(f"nothing to score: no split of the {len(ids)} tokens (the continuation is empty)")
    bad_start = next((c for c in starts if not 0 < c < len(ids)), None)
    if bad_start is not None:
        raise ValueError(f"the continuation must start inside the sequence (1..{len(ids) - 1}), got {bad_start}")
    if len(ids) > model.config.max_position_embeddings:
        raise ValueError(f"{len(ids)} tokens are more than the model's context of "
                         f"{model.config.max_position_embeddings}")
    vocab = model.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    mask = model.config.mask_token_id
    if mask in ids:
        raise ValueError(f"token id {mask} is the model's mask token: a sequence holding it cannot be scored (the "
                         "estimate masks tokens itself, and a visible mask reads as one it masked)")


def scoring_work(job: ScoreJob) -> int:
    """About how many token positions the forwards of ``job`` run: each split's draws, coupled along the chain,
    give about ``samples x (continuation) / 2`` distinct masked rows, plus one row a position for the top tokens,
    each a forward of the whole sequence."""
    n, length = len(job.token_ids), len(job.token_ids) - job.start
    return (job.samples * length // 2 + (length if job.top_k else 0) + 1) * n


def validate(model: DiffusionLM, job: ScoreJob) -> None:
    """Raises the ValueError :func:`score_jobs` would raise for ``job``, before any work."""
    _check_top_k(job.top_k)
    _check(model, job.token_ids, range(job.start, len(job.token_ids)), job.samples)


def _check_top_k(top_k: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer, got {top_k!r}")


@dataclass(frozen=True)
class _Draws:
    """The draws of splits ``first..n-1``: ``masks [R, n]`` the distinct masked sets drawn (one row each),
    ``row [n - first, samples]`` the one split ``first + i``'s sample ``s`` drew, ``size`` its ``l``."""

    masks: torch.Tensor
    row: torch.Tensor
    size: torch.Tensor


def _chained_draws(n: int, first: int, samples: int, generator: torch.Generator) -> _Draws:
    """Every split's draws, one chain a sample from split ``n - 1`` back to ``first`` (the module docstring).
    Each step takes three uniforms a sample, so the draws of split ``c`` do not depend on ``first <= c``."""
    cols = torch.arange(n)
    steps = n - first
    members = torch.full((samples, steps), n - 1)  # the masked columns of each chain, its first ``l`` entries
    size = torch.ones(samples, dtype=torch.long)
    row = torch.zeros(steps, samples, dtype=torch.long)
    sizes = torch.ones(steps, samples, dtype=torch.long)
    masks = [cols[None, :] == n - 1]
    count = 1
    every = torch.arange(samples)
    for i in range(1, steps):
        c, length = n - 1 - i, i  # this step adds column c to the ``length`` columns of split c + 1
        u = torch.rand(samples, 3, generator=generator, dtype=torch.float64)
        full = u[:, 0] * (length + 1) < 1
        swap = ~full & (u[:, 1] * (length + 1) < size)
        slot = (u[:, 2] * size).long().clamp_max(size - 1)
        members[every[swap], slot[swap]] = c
        members[full, :length + 1] = torch.arange(c, n)
        size = torch.where(full, length + 1, size)
        current = row[steps - i].clone()  # the rows of split c + 1, index n - 1 - (c + 1) - first
        if bool(full.any()):
            masks.append(cols[None, :] >= c)
            current[full] = count
            count += 1
        changed = every[swap]
        if len(changed):
            picked = members[changed]
            held = torch.arange(steps)[None, :] < size[changed, None]
            new = torch.zeros(len(changed), n + 1, dtype=torch.bool)
            new.scatter_(1, torch.where(held, picked, n), True)
            masks.append(new[:, :n])
            current[changed] = torch.arange(count, count + len(changed))
            count += len(changed)
        row[steps - 1 - i] = current
        sizes[steps - 1 - i] = size
    return _Draws(torch.cat(masks), row, sizes)


def _pack(masks: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """An exact integer key of each mask row: its columns as bits, 62 to an int64 (``chunk`` rows at a time, so
    that the int64 copy never holds more than those)."""
    r, n = masks.shape
    words = -(-n // 62)
    keys = torch.empty(r, words, dtype=torch.long)
    shifts = torch.arange(62)
    for lo in range(0, r, chunk):
        part = masks[lo:lo + chunk]
        padded = torch.zeros(len(part), words * 62, dtype=torch.long)
        padded[:, :n] = part
        keys[lo:lo + chunk] = (padded.view(len(part), words, 62) << shifts).sum(-1)
    return keys


def _distinct(masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of ``masks`` and, for each row, the index of its distinct row."""
    keys, inverse = torch.unique(_pack(masks), dim=0, return_inverse=True)
    first = torch.zeros(len(keys), dtype=torch.long).scatter_(0, inverse, torch.arange(len(masks)))
    return masks[first], inverse


#: fp32 logits held at once while scoring (about 1 GiB): rows are batched to stay under it
LOGIT_BUDGET = 1 << 28


def _rows_per_batch(model: DiffusionLM, columns: int, batch_size: int) -> int:
    return max(1, min(batch_size, LOGIT_BUDGET // max(1, columns * model.config.vocab_size)))


def _batch_rows(batch_size: int, batch_tokens: int | None, n: int) -> int:
    """Rows of ``n`` tokens a forward takes: ``batch_size``, and no more tokens than ``batch_tokens`` (the
    engine's cap on a step, so that a scoring forward holds its lock no longer than a step does)."""
    return batch_size if batch_tokens is None else max(1, min(batch_size, batch_tokens // n))


@dataclass
class _RowSet:
    """Rows of one canvas to forward: ``masks [U, n]`` (distinct), and whether each row's first masked column
    needs its top ``top_k`` tokens; ``cancel``, once set, leaves its rows still to come out (their values unset)."""

    ids: torch.Tensor
    masks: torch.Tensor
    top: torch.Tensor
    top_k: int
    cancel: threading.Event | None = None


@torch.inference_mode()
def _forward_rows(model: DiffusionLM, sets: Sequence[_RowSet], batch_size: int,
                  lock: contextlib.AbstractContextManager | None, cancel: threading.Event | None,
                  batch_tokens: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each set: ``sum over the masked columns of log p(true token)`` of every row (float64), and the top
    tokens' values and ids at the first masked column of the rows flagged ``top``. Rows of sets of the same
    length share forwards, fewest masked columns first (so a batch pads its logit columns little); results
    stay on the device until every batch is done."""
    dev = model.device
    out: list[list] = [[None, None, None] for _ in sets]
    by_length: dict[int, list[int]] = {}
    for i, s in enumerate(sets):
        by_length.setdefault(s.ids.numel(), []).append(i)
    for n, members in by_length.items():
        rows_cap = _batch_rows(batch_size, batch_tokens, n)
        masks = torch.cat([sets[i].masks for i in members])
        owner = torch.cat([torch.full((len(sets[i].masks),), j) for j, i in enumerate(members)])
        top = torch.cat([sets[i].top for i in members])
        ids = torch.stack([sets[i].ids for i in members]).to(dev)
        k = max(sets[i].top_k for i in members)
        counts = masks.sum(1)
        order = counts.argsort(stable=True)
        positions = torch.arange(n, device=dev)
        sums = torch.empty(len(masks), dtype=torch.float64, device=dev)
        top_values = torch.empty(len(masks), min(k, model.config.vocab_size), device=dev)
        top_ids = torch.empty(len(masks), min(k, model.config.vocab_size), dtype=torch.long, device=dev)
        lo = 0
        gone: set[int] = set()
        while lo < len(order):
            if cancel is not None and cancel.is_set():
                raise ScoringCancelled("scoring was cancelled")
            left = {j for j, i in enumerate(members) if j not in gone and sets[i].cancel is not None
                    and sets[i].cancel.is_set()}
            if left:  # a caller gave up: the rest of its rows are not forwarded
                gone |= left
                rest = order[lo:]
                order, lo = rest[~torch.isin(owner[rest], torch.tensor(sorted(left)))], 0
                continue
            hi = lo + 1
            while hi < len(order) and hi - lo < _rows_per_batch(model, int(counts[order[hi]]), rows_cap):
                hi += 1
            pick = order[lo:hi]
            rows = masks[pick].to(dev)
            canvas = ids[owner[pick].to(dev)]
            fed = torch.where(rows, model.config.mask_token_id, canvas)
            cols, valid = compact_index(rows, fill=0)
            with lock if lock is not None else contextlib.nullcontext():
                hidden = model(fed, positions.expand(len(pick), -1)).hidden
                logp = torch.log_softmax(model.logits(hidden, cols), dim=-1)
            true = logp.gather(-1, canvas.gather(1, cols)[..., None])[..., 0].double()
            sums[pick.to(dev)] = (true * valid).sum(dim=1)
            wanted = top[pick]
            if k and bool(wanted.any()):
                values, index = logp[wanted.to(dev), 0].topk(top_values.shape[1], dim=-1)
                where = pick[wanted].to(dev)
                top_values[where], top_ids[where] = values, index
            lo = hi
        sums, top_values, top_ids = sums.cpu(), top_values.cpu(), top_ids.cpu()
        for j, i in enumerate(members):
            mine = owner == j
            out[i] = [sums[mine], top_values[mine, :sets[i].top_k], top_ids[mine, :sets[i].top_k]]
    return [tuple(o) for o in out]


@dataclass(frozen=True)
class _Plan:
    """One job's draws, mapped onto the rows of its :class:`_RowSet`: ``row [len(starts), samples]``,
    ``weight`` the draws' ``L / l``, and for each position from ``top_from`` the row of its top tokens."""

    starts: list[int]
    row: torch.Tensor
    weight: torch.Tensor
    top_from: int
    top_row: torch.Tensor


def _plan(token_ids: Sequence[int], starts: Sequence[int], samples: int, generator: torch.Generator,
          top_from: int | None, top_k: int) -> tuple[_RowSet, _Plan]:
    """The distinct masked rows the splits ``starts`` drew (plus, from ``top_from``, each position's row with it
    and everything after it masked, whose first column gives the top tokens)."""
    n = len(token_ids)
    first = min(starts)
    draws = _chained_draws(n, first, samples, generator)
    index = torch.tensor([c - first for c in starts])
    row, size = draws.row[index], draws.size[index]
    masks = draws.masks
    top_masks = torch.zeros(0, n, dtype=torch.bool)
    if top_from is not None:
        top_masks = torch.arange(n)[None, :] >= torch.arange(top_from, n)[:, None]
    used, local = torch.unique(row, return_inverse=True)  # only the rows these splits drew
    distinct, inverse = _distinct(torch.cat([masks[used], top_masks]))
    top = torch.zeros(len(distinct), dtype=torch.bool)
    top_row = inverse[len(used):]
    top[top_row] = top_k > 0
    length = (n - torch.tensor(list(starts)))[:, None]
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    plan = _Plan(list(starts), inverse[:len(used)][local], (length / size).double(),
                 top_from if top_from is not None else n, top_row)
    return _RowSet(ids, distinct, top, top_k), plan


def _run(model: DiffusionLM, plans: Sequence[tuple[_RowSet, _Plan]], batch_size: int,
         lock: contextlib.AbstractContextManager | None, cancel: threading.Event | None,
         batch_tokens: int | None = None) -> list[tuple[torch.Tensor, list[dict[int, float]]]]:
    """Each plan's draws ``[len(starts), samples]`` (float64) and its top tokens."""
    results = _forward_rows(model, [s for s, _ in plans], batch_size, lock, cancel, batch_tokens)
    out = []
    for (_, plan), (sums, top_values, top_ids) in zip(plans, results, strict=True):
        tops = [dict(zip(top_ids[r].tolist(), top_values[r].tolist(), strict=True)) for r in plan.top_row.tolist()]
        out.append((sums[plan.row] * plan.weight, tops))
    return out


def block_spans(model: DiffusionLM, n: int, first: int) -> list[tuple[int, int]]:
    """The column ranges of ``first..n`` scored apart: one range, or, for a block-causal model, one a block of its
    attention (``position // block_size``), where a block is decoded given the blocks before it, clean, and never
    sees the blocks after it. Its bound is then the sum of each block's bound with the earlier blocks unmasked:
    masking earlier blocks' tokens too, as the whole-sequence bound does, scores a canvas its decoding never
    reads."""
    size = model.config.block_size if getattr(model, "block_causal", False) else None
    if not size:
        return [(first, n)]
    spans, a = [], first
    while a < n:
        e = min(n, (a // size + 1) * size)
        spans.append((a, e))
        a = e
    return spans


def bound_draws(model: DiffusionLM, token_ids: Sequence[int], starts: Sequence[int], samples: int,
                generator: torch.Generator, batch_size: int = 64,
                lock: contextlib.AbstractContextManager | None = None,
                cancel: threading.Event | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every single draw of the bound: ``samples`` values for each split in ``starts`` (float64), and the
    index into ``starts`` each belongs to. The samples of one split are independent; those of different
    splits are coupled (the module docstring). On a block-causal model a split's draw is the sum of its
    blocks' (:func:`block_spans`), each block drawn on its own, the last first."""
    _check(model, token_ids, starts, samples)
    spans = block_spans(model, len(token_ids), min(starts))
    if len(spans) == 1:
        draws, _ = _run(model, [_plan(token_ids, starts, samples, generator, None, 0)], batch_size, lock, cancel)[0]
        return draws.reshape(-1), torch.arange(len(starts)).repeat_interleave(samples)
    needs, plans = [], []
    for a, e in reversed(spans):  # each block's splits asked for, and its first column where a later block's tail
        need = sorted({c for c in starts if a <= c < e} | ({a} if any(c < a for c in starts) else set()))
        needs.append(need)
        plans.append(_plan(token_ids[:e], need, samples, generator, None, 0))
    at: dict[int, torch.Tensor] = {}
    for need, (draws, _) in zip(needs, _run(model, plans, batch_size, lock, cancel), strict=True):
        at.update({c: draws[i] for i, c in enumerate(need)})
    per = [at[c] + sum((at[a] for a, _ in spans if a > c), torch.zeros(samples, dtype=torch.float64))
           for c in starts]
    return torch.stack(per).reshape(-1), torch.arange(len(starts)).repeat_interleave(samples)


def split_estimates(model: DiffusionLM, token_ids: Sequence[int], starts: Sequence[int], samples: int,
                    generator: torch.Generator, batch_size: int = 64,
                    lock: contextlib.AbstractContextManager | None = None,
                    cancel: threading.Event | None = None) -> list[float]:
    """``E_c``, the Monte Carlo estimate of ``log p(token_ids[c:] | token_ids[:c])``, for each ``c`` in
    ``starts``: the mean of its draws. ``lock`` is held around each forward (the server's engine lock);
    ``cancel``, when set, stops the work between two batches (:class:`ScoringCancelled`)."""
    draws, owner = bound_draws(model, token_ids, starts, samples, generator, batch_size, lock, cancel)
    totals = torch.zeros(len(starts), dtype=torch.float64).index_add_(0, owner, draws)
    return (totals / samples).tolist()


def continuation_logprob(model: DiffusionLM, context: Sequence[int], continuation: Sequence[int], samples: int,
                         generator: torch.Generator, batch_size: int = 64) -> float:
    """The estimate of ``log p(continuation | context)``: what a multiple-choice evaluation compares. The same
    seed gives it the draws :func:`token_logprobs` gives this split on the same tokens."""
    if not continuation:
        raise ValueError("the continuation is empty")
    if not context:
        raise ValueError("the context is empty: a continuation is scored given at least one token before it")
    return split_estimates(model, [*context, *continuation], [len(context)], samples, generator, batch_size)[0]


def score_jobs(model: DiffusionLM, jobs: Sequence[ScoreJob], batch_size: int = 64,
               lock: contextlib.AbstractContextManager | None = None,
               cancel: threading.Event | None = None, batch_tokens: int | None = None) -> list[TokenLogprobs]:
    """:func:`token_logprobs` of several sequences at once: each job draws from its own generator, so its
    values are those it gets alone (to float tolerance: batches are composed differently), while the rows of
    jobs of one length share forwards (an echo's prompt and its continuation, a batch of choices). A forward
    takes at most ``batch_size`` rows and ``batch_tokens`` tokens; ``cancel`` is read between jobs' plans too. A job
    whose own ``cancel`` is set before the end gets None: the rest of its rows were left out."""
    plans, blocks = [], []
    for job in jobs:
        validate(model, job)
    for job in jobs:
        if cancel is not None and cancel.is_set():
            raise ScoringCancelled("scoring was cancelled")
        spans = block_spans(model, len(job.token_ids), job.start)
        blocks.append(len(spans))
        for a, e in reversed(spans):  # a block-causal model's blocks apart, the last drawn first (bound_draws)
            rows, plan = _plan(job.token_ids[:e], range(a, e), job.samples, job.generator,
                               a if job.top_k else None, job.top_k)
            rows.cancel = job.cancel
            plans.append((rows, plan))
    results = iter(_run(model, plans, batch_size, lock, cancel, batch_tokens))
    out = []
    for job, count in zip(jobs, blocks, strict=True):
        mine = [next(results) for _ in range(count)]
        if job.cancel is not None and job.cancel.is_set():
            out.append(None)
            continue
        values, tops = [], []
        for draws, block_tops in reversed(mine):
            # telescoped within the block: the later blocks' estimates are in both E_c and E_(c+1)
            estimates = (draws.sum(1) / job.samples).tolist() + [0.0]
            values += [estimates[i] - estimates[i + 1] for i in range(len(estimates) - 1)]
            tops += block_tops
        if job.top_k:
            tops = [{**top, token: value} if top and max(top, key=top.__getitem__) == token else top
                    for token, value, top in zip(job.token_ids[job.start:], values, tops, strict=True)]
        else:
            tops = [{} for _ in values]
        out.append(TokenLogprobs(list(job.token_ids), job.start, values, tops))
    return out


def token_logprobs(model: DiffusionLM, token_ids: Sequence[int], start: int, samples: int,
                   generator: torch.Generator, top_k: int = 0, batch_size: int = 64,
                   lock: contextlib.AbstractContextManager | None = None,
                   cancel: threading.Event | None = None) -> TokenLogprobs:
    """Telescoped per-token values for ``token_ids[start:]``: those from any ``c >= start`` to the end add
    up to ``E_c``, the estimate of ``log p(token_ids[c:] | token_ids[:c])`` on this canvas."""
    return score_jobs(model, [ScoreJob(token_ids, start, samples, generator, top_k)], batch_size, lock,
                      cancel)[0]
