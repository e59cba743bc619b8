"""Probe: does a checkpoint's attention read a worksheet from the answer's side, and does it survive the shift?

The diagnostic behind docs/model.md's block-diffusion section. A checkpoint's weights are put into a
Fast-dLLM v2 model of the same shape (as the trainer's ``init_from`` does) and asked held-out prefix
questions of qa1 and ``count`` (one lookup each) with one forward: the first answer token's argmax,
against the truth. Four ways: bidirectional or block-causal attention (blocks of 8), logits shifted or
not. Under a block-causal mask the story's tokens never see the question, so a model scores there only if
its answer column makes the lookup itself; with the shift the column before the answer (``:``) must make
it. An R2LM checkpoint is also asked in its own family, with and without its reverse scan.

    python -m acache_lab.probes.shift --model models/acache-tiny
    python -m acache_lab.probes.shift --model models/acache-tiny-r2lm
"""

from __future__ import annotations

import argparse
import dataclasses
import random

import torch

from acache.cli import _positive_int
from acache.models.checkpoint import family_model
from acache.models.r2lm import R2LM
from acache_lab.probes.common import open_model
from acache_lab.tasks.generators import EVAL_SEED_BASE, TRAIN_GENERATORS, Example
from acache_lab.tasks.render import SPECIAL_TOKENS, build_word_tokenizer, render
from acache_lab.train.trainer import start_from_


def questions(task: str, n: int) -> list[Example]:
    """``n`` held-out questions of ``task`` (warm-ups included) over 6-sentence contexts."""
    out: list[Example] = []
    seed = EVAL_SEED_BASE
    while len(out) < n:
        out += TRAIN_GENERATORS[task](random.Random(seed), 6)
        seed += 1
    return out[:n]


def first_token_accuracy(logits_at, examples: list[Example], encode, mask_id: int) -> float:
    """Share of ``examples`` whose first answer token is the argmax of ``logits_at(ids, column)``."""
    right = 0
    for example in examples:
        rendered = render(example, "prefix", encode, 0)
        ids, at = list(rendered.prompt.token_ids), rendered.prompt.gen_at
        full = ids[:at] + [mask_id] * len(rendered.answer) + ids[at:]
        right += int(logits_at(torch.tensor([full]), at).argmax()) == rendered.answer[0]
    return right / len(examples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/acache-tiny")
    ap.add_argument("--questions", type=_positive_int, default=200)
    args = ap.parse_args()
    tokenizer = build_word_tokenizer()

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    source = open_model(ap, args.model)
    if not hasattr(source.config, "rope_theta"):
        ap.error(f"{args.model}: a {source.family} model has no rotary positions to shift")
    spec = SPECIAL_TOKENS["llada"]
    shape = source.config
    model = family_model("fast_dllm_v2", shape.vocab_size, tokenizer.token_to_id(spec["mask"]),
                         tokenizer.token_to_id(spec["eos"]), layers=shape.num_layers, hidden_size=shape.hidden_size,
                         heads=shape.num_heads, intermediate_size=shape.intermediate_size,
                         rope_theta=shape.rope_theta, block_size=8)
    start_from_(model, args.model)
    model.eval()
    mask_id = model.config.mask_token_id
    sets = {task: questions(task, args.questions) for task in ("qa1", "count")}

    def grafted(ids: torch.Tensor, at: int) -> torch.Tensor:
        with torch.no_grad():
            out = model(ids, torch.arange(ids.shape[1])[None])
            return model.logits(out.hidden, slice(at, at + 1))[0, 0]

    for block, shifted in ((None, False), (8, False), (8, True)):
        model.config = dataclasses.replace(model.config, block_size=block)
        model.shifted_logits = shifted
        scores = {t: first_token_accuracy(grafted, exs, encode, mask_id) for t, exs in sets.items()}
        print(f"{args.model} as Fast-dLLM v2, {'block-causal' if block else 'bidirectional'}, "
              f"{'shifted' if shifted else 'unshifted'}: " + ", ".join(f"{t} {s:.1%}" for t, s in scores.items()),
              flush=True)
    if isinstance(source, R2LM):
        def native(ids: torch.Tensor, at: int) -> torch.Tensor:
            with torch.no_grad():
                return source.train_logits(ids, torch.ones_like(ids, dtype=torch.bool))[0, at]

        for silenced in (False, True):
            if silenced:
                with torch.no_grad():
                    for name, p in source.named_parameters():
                        if "sidecar" in name and name.endswith("out_proj.weight"):
                            p.zero_()
            scores = {t: first_token_accuracy(native, exs, encode, mask_id) for t, exs in sets.items()}
            print(f"{args.model} as R2LM, {'reverse scan silenced' if silenced else 'as trained'}: "
                  + ", ".join(f"{t} {s:.1%}" for t, s in scores.items()), flush=True)


if __name__ == "__main__":
    main()
