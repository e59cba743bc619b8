"""The canvas a batch is decoded on: prompt tokens, the masked generation region, and padding.

A prompt may continue after its generation region (suffix affixes, infilling), so a layout is the
prompt's token ids plus the index ``gen_at`` where the region is inserted. Rows are padded on the left
so every generation region starts at the same column, and on the right to the longest tail; padding is
never attended and each row's positions count only its own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    token_ids: tuple[int, ...]
    gen_at: int  # the generation region goes before token_ids[gen_at]

    def __post_init__(self) -> None:
        if not 0 <= self.gen_at <= len(self.token_ids):
            raise ValueError(f"generation region index {self.gen_at} is outside the prompt of "
                             f"{len(self.token_ids)} tokens")

    @classmethod
    def of(cls, prompt: Sequence[int] | Layout) -> Layout:
        """A plain prompt generates after its last token."""
        if isinstance(prompt, Layout):
            return prompt
        ids = tuple(int(t) for t in prompt)
        return cls(ids, len(ids))


@dataclass
class Canvas:
    tokens: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T] False on padding
    gen_start: int  # first column of the generation region (the same in every row)
    gen_length: int
    pad_left: list[int]  # left padding of each row
    layouts: list[Layout]

    @property
    def total(self) -> int:
        return self.tokens.shape[1]

    def column(self, row: int, index: int) -> int:
        """Canvas column of prompt token ``index`` of ``row``."""
        shift = self.gen_length if index >= self.layouts[row].gen_at else 0
        return self.pad_left[row] + index + shift


def build_canvas(prompts: Sequence[Sequence[int] | Layout], gen_length: int, mask_id: int, pad_id: int,
                 device: torch.device) -> Canvas:
    layouts = [Layout.of(p) for p in prompts]
    before = max(lay.gen_at for lay in layouts)
    after = max(len(lay.token_ids) - lay.gen_at for lay in layouts)
    b, total = len(layouts), before + gen_length + after
    tokens = torch.full((b, total), pad_id, dtype=torch.long)
    valid = torch.zeros((b, total), dtype=torch.bool)
    pad_left = []
    for row, lay in enumerate(layouts):
        pad = before - lay.gen_at
        pad_left.append(pad)
        ids = torch.tensor(lay.token_ids, dtype=torch.long)
        tail = len(lay.token_ids) - lay.gen_at
        tokens[row, pad:before] = ids[:lay.gen_at]
        tokens[row, before + gen_length:before + gen_length + tail] = ids[lay.gen_at:]
        valid[row, pad:before + gen_length + tail] = True
    tokens[:, before:before + gen_length] = mask_id
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    return Canvas(tokens.to(device), positions.to(device), valid.to(device), before, gen_length, pad_left, layouts)
