"""Log-likelihoods of a diffusion LM, estimated as LLaDA's paper scores multiple-choice answers.

A masked diffusion model has no left-to-right factorisation, so ``log p(continuation | context)`` is
estimated by the bound LLaDA evaluates with (its Eq. 6, the lower-variance form): draw ``l`` uniformly from
``1..L`` (``L`` continuation tokens), mask ``l`` of them chosen uniformly without replacement, and score
``(L / l) * sum over the masked tokens of log p(token | context, the unmasked rest)``; the estimate is the mean
over ``samples`` such draws. Every draw comes from the caller's ``torch.Generator``, so a seed fixes it.

An OpenAI client asking for ``echo`` + ``logprobs`` does not say where its context ends (lm-eval sends
context and continuation as one prompt and sums the per-token values after its own split). So per-token
values are built by telescoping: with ``E_c`` the estimate for the split at ``c`` on the same canvas,
token ``c`` gets ``E_c - E_{c+1}``, and the values from any ``c`` to the end add up to ``E_c`` exactly. One
value alone is a difference of two estimates, not a probability (it can even be positive); only such sums
are meaningful. The cost is ``samples`` forwards a split, batched ``batch_size`` rows at a time.
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
    ``top`` most likely tokens at each of those positions with the tokens after it masked."""

    token_ids: list[int]
    start: int
    values: list[float]
    top: list[dict[int, float]]


class ScoringCancelled(RuntimeError):
    """The caller gave up (``cancel`` was set): scoring stopped between two batches."""


def _check(model: DiffusionLM, ids: Sequence[int], starts: Sequence[int], samples: int) -> None:
    if isinstance(samples, bool) or not isinstance(samples, int) or samples <= 0:
        raise ValueError(f"samples must be a positive integer, got {samples!r}")
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


def _masked_rows(n: int, starts: Sequence[int], samples: int, generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each split and sample: which columns are masked ``[R, n]``, the draw's weight ``L / l`` and which
    split it belongs to. ``l`` is uniform in ``1..L`` and the ``l`` masked columns a uniform subset of the
    split's ``L``: the first ``l`` of a random order of them."""
    start = torch.tensor(list(starts)).repeat_interleave(samples)
    length = n - start
    masked = (torch.rand(len(start), generator=generator, dtype=torch.float64) * length).long() + 1
    cols = torch.arange(n)
    inside = cols[None, :] >= start[:, None]
    keys = torch.where(inside, torch.rand(len(start), n, generator=generator), torch.full((len(start), n), 2.0))
    rank = keys.argsort(dim=1).argsort(dim=1)  # a random order of the split's columns, the others last
    owner = torch.arange(len(starts)).repeat_interleave(samples)
    return rank < masked[:, None], (length / masked).double(), owner


#: fp32 logits held at once while scoring (about 1 GiB): rows are batched to stay under it
LOGIT_BUDGET = 1 << 28


def _rows_per_batch(model: DiffusionLM, columns: int, batch_size: int) -> int:
    return max(1, min(batch_size, LOGIT_BUDGET // max(1, columns * model.config.vocab_size)))


def _token_logprobs(model: DiffusionLM, hidden: torch.Tensor, cols: torch.Tensor, targets: torch.Tensor
                    ) -> torch.Tensor:
    """``log p(targets)`` at the fed columns ``cols [B, K]``: logits of those columns only."""
    logits = model.logits(hidden, cols)
    return logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)


@torch.inference_mode()
def _masked_logprobs(model: DiffusionLM, ids: torch.Tensor, masks: torch.Tensor, batch_size: int,
                     lock: contextlib.AbstractContextManager | None,
                     cancel: threading.Event | None = None) -> torch.Tensor:
    """``sum over the masked columns of log p(true token)`` for each row of ``masks``, in float64."""
    dev = model.device
    n = ids.numel()
    positions = torch.arange(n, device=dev)
    ids = ids.to(dev)
    out = []
    step = _rows_per_batch(model, int(masks.sum(1).max()) if masks.numel() else 1, batch_size)
    for lo in range(0, masks.shape[0], step):
        if cancel is not None and cancel.is_set():
            raise ScoringCancelled("scoring was cancelled")
        rows = masks[lo:lo + step].to(dev)
        fed = torch.where(rows, torch.full_like(rows, model.config.mask_token_id, dtype=torch.long),
                          ids.expand(rows.shape[0], -1))
        cols, valid = compact_index(rows, fill=0)
        with lock if lock is not None else contextlib.nullcontext():
            hidden = model(fed, positions.expand(rows.shape[0], -1)).hidden
            true = _token_logprobs(model, hidden, cols, ids[cols]).double()
        out.append((true * valid).sum(dim=1).cpu())
    return torch.cat(out)


def bound_draws(model: DiffusionLM, token_ids: Sequence[int], starts: Sequence[int], samples: int,
                generator: torch.Generator, batch_size: int = 64,
                lock: contextlib.AbstractContextManager | None = None,
                cancel: threading.Event | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every single draw of the bound: ``samples`` values for each split in ``starts`` (float64), and the
    index into ``starts`` each belongs to."""
    _check(model, token_ids, starts, samples)
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    masks, weights, owner = _masked_rows(len(token_ids), starts, samples, generator)
    return _masked_logprobs(model, ids, masks, batch_size, lock, cancel) * weights, owner


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
    """The estimate of ``log p(continuation | context)``: what a multiple-choice evaluation compares."""
    if not continuation:
        raise ValueError("the continuation is empty")
    return split_estimates(model, [*context, *continuation], [len(context)], samples, generator, batch_size)[0]


@torch.inference_mode()
def _top_tokens(model: DiffusionLM, ids: torch.Tensor, start: int, k: int, batch_size: int,
                lock: contextlib.AbstractContextManager | None,
                cancel: threading.Event | None = None) -> list[dict[int, float]]:
    """At each position from ``start``: the ``k`` most likely tokens given what precedes it, with it and
    everything after it masked."""
    n = ids.numel()
    if k == 0:
        return [{} for _ in range(start, n)]
    dev = model.device
    positions = torch.arange(n, device=dev)
    cols = torch.arange(start, n)
    masks = torch.arange(n)[None, :] >= cols[:, None]
    top: list[dict[int, float]] = []
    step = _rows_per_batch(model, 1, batch_size)
    for lo in range(0, len(cols), step):
        if cancel is not None and cancel.is_set():
            raise ScoringCancelled("scoring was cancelled")
        rows = masks[lo:lo + step].to(dev)
        fed = torch.where(rows, torch.full_like(rows, model.config.mask_token_id, dtype=torch.long),
                          ids.to(dev).expand(rows.shape[0], -1))
        with lock if lock is not None else contextlib.nullcontext():
            hidden = model(fed, positions.expand(rows.shape[0], -1)).hidden
            logp = torch.log_softmax(model.logits(hidden, cols[lo:lo + step].to(dev)[:, None]), dim=-1)
        values, index = logp[:, 0].topk(min(k, logp.shape[-1]), dim=-1)
        top += [dict(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(index, values, strict=True)]
    return top


def token_logprobs(model: DiffusionLM, token_ids: Sequence[int], start: int, samples: int,
                   generator: torch.Generator, top_k: int = 0, batch_size: int = 64,
                   lock: contextlib.AbstractContextManager | None = None,
                   cancel: threading.Event | None = None) -> TokenLogprobs:
    """Telescoped per-token values for ``token_ids[start:]``: those from any ``c >= start`` to the end add
    up to ``E_c``, the estimate of ``log p(token_ids[c:] | token_ids[:c])`` on this canvas."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer, got {top_k!r}")
    n = len(token_ids)
    estimates = split_estimates(model, token_ids, range(start, n), samples, generator, batch_size, lock,
                                cancel) + [0.0]
    values = [estimates[i] - estimates[i + 1] for i in range(n - start)]
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    return TokenLogprobs(list(token_ids), start, values,
                         _top_tokens(model, ids, start, top_k, batch_size, lock, cancel))
