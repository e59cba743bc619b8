"""Requests with affixes at each position, built from random token ids."""

from __future__ import annotations

import torch

from acache.affix.prompt import AffixPrompt


def layouts(affix_len: int = 20, question_len: int = 6, seed: int = 0) -> dict[str, AffixPrompt]:
    g = torch.Generator().manual_seed(seed)
    aff = torch.randint(0, 256, (affix_len,), generator=g).tolist()
    sys_aff = torch.randint(0, 256, (8,), generator=g).tolist()
    q = torch.randint(0, 256, (question_len,), generator=g).tolist()
    h = question_len // 2
    n = affix_len
    return {
        "prefix": AffixPrompt.from_spans(aff + q, None, [(0, n)]),
        "infix": AffixPrompt.from_spans(q[:h] + aff + q[h:], None, [(h, h + n)]),
        "suffix": AffixPrompt.from_spans(q + aff, question_len, [(question_len, question_len + n)]),
        "two-affix": AffixPrompt.from_spans(sys_aff + q[:h] + aff + q[h:], None,
                                            [(0, 8, "system"), (8 + h, 8 + h + n, "doc")]),
    }
