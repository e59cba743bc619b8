"""Calibration requests for BiCache profiling: from a JSONL file, or random-token requests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from acache.affix.prompt import Affix, AffixPrompt, layout_segments, resolve_segments
from acache.models.config import ModelConfig
from acache.models.tokenizer import Tokenizer
from acache.policies import LAYOUTS


def calibration_prompts(tokenizer: Tokenizer, config: ModelConfig, path: str | Path | None, samples: int,
                        seed: int = 0) -> list[AffixPrompt]:
    """Each JSONL line is ``{"affix": str, "prompt": str, "layout": "prefix"|"infix"|"suffix",
    "answer_prompt": str}``; without a path, ``samples`` random-token requests with affixes of varied share."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"calibration file not found: {path}")
        prompts = []
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                segs = layout_segments(item.get("layout", "prefix"), Affix(item["affix"]), item["prompt"],
                                       item.get("answer_prompt", ""))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a calibration record ({exc})") from None
            prompts.append(resolve_segments(segs, encode))
        if not prompts:
            raise ValueError(f"{path} holds no calibration records")
        return prompts
    gen = torch.Generator().manual_seed(seed)
    specials = {config.mask_token_id, config.eos_token_id, config.pad_token_id}
    vocab = min(config.vocab_size, tokenizer.vocab_size)

    def tokens(n: int) -> list[int]:
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        return [t if t not in specials else 0 for t in ids]

    prompts = []
    for i in range(samples):
        affix_len = int(torch.randint(8, 160, (1,), generator=gen))
        question_len = int(torch.randint(4, 96, (1,), generator=gen))
        segs = layout_segments(LAYOUTS[i % 3], Affix(token_ids=tokens(affix_len)), tokens(question_len))
        prompts.append(resolve_segments(segs, encode))
    return prompts
