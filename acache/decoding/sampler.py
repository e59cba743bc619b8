"""Turns logits into proposed tokens and their confidences."""

from __future__ import annotations

import torch


def propose(logits: torch.Tensor, temperature: float, generators: list[torch.Generator | None] | None = None,
            active: list[bool] | None = None, mask_token_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposed tokens ``x0`` and confidences ``p(x0)`` for ``logits [B, L, V]``.

    Temperature 0 takes the argmax; otherwise Gumbel-max sampling from ``softmax(logits / T)``, with
    noise from each row's own generator so a request's draw does not depend on its batch; rows that are
    not ``active`` (their block is done) draw nothing, so each generator advances only on the request's
    own steps. ``mask_token_id`` is never proposed: committing ``[MASK]`` would leave a hole in the output.

    Confidence is ``p(x0)`` under the softmax over the *whole* vocabulary, ``[MASK]`` included, as the
    upstream LLaDA and Fast-dLLM code score it: taking it after removing ``[MASK]`` would raise it to
    ``p(x0) / (1 - p(mask))`` and change which tokens a threshold or factor rule commits.
    """
    logits = logits.float()
    # log p(x0) = logit(x0) - logsumexp(logits): one reduction a row, no [B, L, V] log-softmax written out
    log_norm = torch.logsumexp(logits, -1)
    if temperature > 0:
        # argmax of logits / T + Gumbel, written as logits - T * log(Exp noise) (the same ranking): a tiny T
        # never overflows to infinities, where every score of a row would tie
        scores = logits.double()
        if mask_token_id is not None:
            scores[..., mask_token_id] = float("-inf")
        noise = torch.ones_like(scores)
        for row in range(scores.shape[0]):
            if active is not None and not active[row]:
                continue
            gen = generators[row] if generators is not None else None
            noise[row].exponential_(generator=gen)
        x0 = (scores - temperature * noise.log()).max(-1).indices
    else:
        x0 = first_max(logits, mask_token_id)
    conf = (logits.gather(-1, x0[..., None]).squeeze(-1) - log_norm).exp()
    return x0, conf


def first_max(logits: torch.Tensor, excluded: int | None = None) -> torch.Tensor:
    """``argmax`` over the last axis with ``excluded`` never chosen: the first maximum among the other tokens.

    ``max().indices`` (argmax's first maximum, at under half its cost on CPU) over all tokens is that unless it
    lands on ``excluded``; only the positions where it does are taken again without it, so no copy of the
    logits is made in the common case."""
    x0 = logits.max(-1).indices
    if excluded is not None:
        hit = x0 == excluded
        if bool(hit.any()):
            without = logits.index_fill(-1, torch.tensor([excluded], device=logits.device), float("-inf"))
            x0 = torch.where(hit, without.max(-1).indices, x0)
    return x0
