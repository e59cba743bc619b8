"""Probe: how much each layer writes into the residual stream, ``||x_out - x_in|| / ||x_in||`` per token.

A deepened model (:mod:`acache_lab.train.expand`) starts with silent inserted layers; whether training woke them is
what says whether a run tested depth at all (docs/accuracy.md, "A thirteenth run"). Averaged over the tokens of
held-out prompts of the short study's three tasks (qa1, arithmetic, two-hop), each in context with its answer masked.

    python -m acache_lab.probes.layer_updates --model build/affix-deep build/affix-deep-v13
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from tokenizers import Tokenizer

from acache.models.base import DiffusionLM
from acache_lab.probes.common import open_model
from acache_lab.tasks.generators import TASKS, Example, held_out


@torch.no_grad()
def layer_updates(model: DiffusionLM, prompts: Sequence[Sequence[int]]) -> list[float]:
    """Per layer, the mean over every token of ``prompts`` (token ids, run one at a time in context) of the norm of
    what the layer adds to the residual stream relative to the norm it reads."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("layer_updates needs at least one prompt, none of them empty")
    layers = len(model.layers)
    total, count = torch.zeros(layers, dtype=torch.float64), 0
    for ids in prompts:
        tokens = torch.tensor([list(ids)], device=model.device)
        positions = torch.arange(tokens.shape[1], device=model.device)[None]
        out = model.run_layers(model.embed(tokens), positions, None, None, range(layers), capture_inputs=True)
        states = [x.float() for x in out.layer_inputs]
        for layer in range(layers):
            ratio = (states[layer + 1] - states[layer]).norm(dim=-1) / states[layer].norm(dim=-1).clamp_min(1e-12)
            total[layer] += float(ratio.sum())
        count += tokens.shape[1]
    return (total / count).tolist()


def task_prompts_in_context(tokenizer: Tokenizer, examples: Sequence[Example], mask_id: int,
                            eos_id: int) -> list[list[int]]:
    """Each example's prefix-layout training row with its answer masked (the canvas a first step decodes, as the
    trainer's probe reads it)."""
    from acache_lab.tasks.render import render
    from acache_lab.train.trainer import answer_row

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    out = []
    for example in examples:
        rendered = render(example, "prefix", encode, eos_id)
        out.append(answer_row(rendered.prompt, [mask_id] * len(rendered.answer)).ids)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["models/acache-tiny-affix"])
    parser.add_argument("--examples", type=int, default=30, help="held-out requests a task")
    parser.add_argument("--sentences", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.examples < 1 or args.sentences < 1:
        parser.error("--examples and --sentences must be at least 1")
    from acache.models.checkpoint import SPECIAL_TOKENS
    from acache_lab.tasks.render import build_word_tokenizer

    tok = build_word_tokenizer()
    spec = SPECIAL_TOKENS["llada"]
    examples = [e for task in TASKS for e in held_out(task, args.examples, args.sentences, args.seed)]
    prompts = task_prompts_in_context(tok, examples, tok.token_to_id(spec["mask"]), tok.token_to_id(spec["eos"]))
    for path in args.model:
        updates = layer_updates(open_model(parser, path, attention=True).eval(), prompts)
        print(f"{path}: " + " ".join(f"{u:.3f}" for u in updates), flush=True)


if __name__ == "__main__":
    main()
