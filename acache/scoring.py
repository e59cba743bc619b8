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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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


def _check(model: DiffusionLM, ids: Sequence[int], start: int, samples: int) -> None:
    if isinstance(samples, bool) or not isinstance(samples, int) or samples <= 0:
        raise ValueError(f"samples must be a positive integer, got {samples!r}")
    if not 0 < start < len(ids):
        raise ValueError(f"the continuation must start inside the sequence (1..{len(ids) - 1}), got {start}")
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
    split it belongs to."""
    masks, weights, owner = [], [], []
    for k, c in enumerate(starts):
        length = n - c
        for _ in range(samples):
            masked = int(torch.randint(1, length + 1, (1,), generator=generator))
            chosen = torch.randperm(length, generator=generator)[:masked] + c
            row = torch.zeros(n, dtype=torch.bool)
            row[chosen] = True
            masks.append(row)
            weights.append(length / masked)
            owner.append(k)
    return torch.stack(masks), torch.tensor(weights, dtype=torch.float64), torch.tensor(owner)


@torch.inference_mode()
def _masked_logprobs(model: DiffusionLM, ids: torch.Tensor, masks: torch.Tensor, batch_size: int,
                     lock: contextlib.AbstractContextManager | None) -> torch.Tensor:
    """``sum over the masked columns of log p(true token)`` for each row of ``masks``, in float64."""
    dev = model.device
    n = ids.numel()
    positions = torch.arange(n, device=dev)
    out = []
    for lo in range(0, masks.shape[0], batch_size):
        rows = masks[lo:lo + batch_size].to(dev)
        fed = torch.where(rows, torch.full_like(rows, model.config.mask_token_id, dtype=torch.long),
                          ids.to(dev).expand(rows.shape[0], -1))
        with lock if lock is not None else contextlib.nullcontext():
            hidden = model(fed, positions.expand(rows.shape[0], -1)).hidden
            logp = torch.log_softmax(model.logits(hidden), dim=-1)
        true = logp.gather(-1, ids.to(dev).expand(rows.shape[0], -1)[..., None])[..., 0].double()
        out.append((true * rows).sum(dim=1).cpu())
    return torch.cat(out)


def bound_draws(model: DiffusionLM, token_ids: Sequence[int], starts: Sequence[int], samples: int,
                generator: torch.Generator, batch_size: int = 64,
                lock: contextlib.AbstractContextManager | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every single draw of the bound: ``samples`` values for each split in ``starts`` (float64), and the
    index into ``starts`` each belongs to."""
    for c in starts:
        _check(model, token_ids, c, samples)
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    masks, weights, owner = _masked_rows(len(token_ids), starts, samples, generator)
    return _masked_logprobs(model, ids, masks, batch_size, lock) * weights, owner


def split_estimates(model: DiffusionLM, token_ids: Sequence[int], starts: Sequence[int], samples: int,
                    generator: torch.Generator, batch_size: int = 64,
                    lock: contextlib.AbstractContextManager | None = None) -> list[float]:
    """``E_c``, the Monte Carlo estimate of ``log p(token_ids[c:] | token_ids[:c])``, for each ``c`` in
    ``starts``: the mean of its draws. ``lock`` is held around each forward (the server's engine lock)."""
    draws, owner = bound_draws(model, token_ids, starts, samples, generator, batch_size, lock)
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
                lock: contextlib.AbstractContextManager | None) -> list[dict[int, float]]:
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
    for lo in range(0, len(cols), batch_size):
        rows = masks[lo:lo + batch_size].to(dev)
        fed = torch.where(rows, torch.full_like(rows, model.config.mask_token_id, dtype=torch.long),
                          ids.to(dev).expand(rows.shape[0], -1))
        with lock if lock is not None else contextlib.nullcontext():
            hidden = model(fed, positions.expand(rows.shape[0], -1)).hidden
            logp = torch.log_softmax(model.logits(hidden, cols[lo:lo + batch_size].to(dev)[:, None]), dim=-1)
        values, index = logp[:, 0].topk(min(k, logp.shape[-1]), dim=-1)
        top += [dict(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(index, values, strict=True)]
    return top


def token_logprobs(model: DiffusionLM, token_ids: Sequence[int], start: int, samples: int,
                   generator: torch.Generator, top_k: int = 0, batch_size: int = 64,
                   lock: contextlib.AbstractContextManager | None = None) -> TokenLogprobs:
    """Telescoped per-token values for ``token_ids[start:]``: those from any ``c >= start`` to the end add
    up to ``E_c``, the estimate of ``log p(token_ids[c:] | token_ids[:c])`` on this canvas."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer, got {top_k!r}")
    n = len(token_ids)
    estimates = split_estimates(model, token_ids, range(start, n), samples, generator, batch_size, lock) + [0.0]
    values = [estimates[i] - estimates[i + 1] for i in range(n - start)]
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    return TokenLogprobs(list(token_ids), start, values, _top_tokens(model, ids, start, top_k, batch_size, lock))
