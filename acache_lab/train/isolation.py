"""Affix-isolated attention: the mask under which a training forward computes what direct reuse serves.

Direct reuse computes each affix alone (its tokens attend only to its own tokens) and lets every other token
attend to everything, the affixes' cached K/V included. A forward whose affix queries see only their own
span's keys, and whose other queries see every valid key, therefore gives every token the states direct
reuse gives it: the same affix K/V at every layer and the same logits elsewhere (RoPE makes attention inside
a span depend on relative positions only, so the span computed at its place in the prompt is the span
computed alone). Training on such forwards teaches a model to be reused (Block-Attention's idea, for a
diffusion LM's bidirectional attention).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Spans = Sequence[tuple[int, int]]


def isolation_mask(valid: torch.Tensor, spans: Sequence[Spans]) -> torch.Tensor:
    """``[B, T, T]``: query ``q`` of row ``b`` may attend key ``k`` when ``k`` is valid and, if ``q`` lies in one
    of the row's ``[start, end)`` spans, ``k`` lies in the same span. A row with no spans attends as usual."""
    if len(spans) != valid.shape[0]:
        raise ValueError(f"spans are given for {len(spans)} rows of a batch of {valid.shape[0]}")
    b, t = valid.shape
    owner = torch.zeros(b, t, dtype=torch.long, device=valid.device)  # 0: no span, n: the row's n-th span
    for row, row_spans in enumerate(spans):
        for n, (start, end) in enumerate(row_spans, start=1):
            if not 0 <= start < end <= t:
                raise ValueError(f"span [{start}, {end}) of row {row} is empty or outside its {t} columns")
            if bool((owner[row, start:end] != 0).any()):
                raise ValueError(f"span [{start}, {end}) of row {row} overlaps another")
            owner[row, start:end] = n
    same = owner[:, :, None] == owner[:, None, :]
    return valid[:, None, :] & ((owner[:, :, None] == 0) | same)
