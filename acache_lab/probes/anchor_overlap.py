"""Probe: how many of the oracle's anchors does each selector pick?

The diagnostic behind docs/accuracy.md's `influence` section. For held-out requests of each task, every
selector chooses its anchors at one ratio on the request's all-mask canvas (its affix's cached K/V placed, as
at admission), by its selection of its own (the two-pass form: ``attention``, served in one pass by default,
filters its candidates inside the first refresh instead, acache/affix/one_pass.py); the score is the share of
the `kv-deviation` oracle's anchors among them, averaged over the requests (a random pick's share is about the
ratio).

    python -m acache_lab.probes.anchor_overlap --model models/acache-tiny --layout prefix
"""

from __future__ import annotations

import argparse

import torch

from acache import LLM
from acache.affix.context import SelectionContext, request_seed
from acache.affix.placement import place_affixes
from acache.affix.selectors import SELECTORS, make_selector
from acache.cli import _positive_int
from acache.decoding.canvas import build_canvas
from acache.policies import LAYOUTS
from acache_lab.eval.tasks import task_prompts
from acache_lab.probes.common import open_llm
from acache_lab.tasks.generators import held_out, parse_tasks
from acache_lab.tasks.render import answer_length


def admission_context(llm: LLM, prompt, gen_length: int) -> SelectionContext:
    """What a selector sees when ``prompt`` is admitted: the all-mask canvas with its affixes' K/V placed, and
    the request's own seed (as the engine draws it, with the study's seed 0). Its recomputed set is the
    non-affix columns, as on LLaDA; the script refuses the families whose set reaches into an affix."""
    model, cfg = llm.model, llm.model.config
    canvas = build_canvas([prompt.layout], gen_length, cfg.mask_token_id, cfg.pad_token_id, model.device)
    entries = [(s.start, llm.affix_store.compute(prompt.affix_ids(s))) for s in prompt.affixes]
    kv, slot = place_affixes(model, canvas, [entries])
    return SelectionContext(model, canvas, slot, kv, [request_seed(0, prompt.token_ids)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/acache-tiny")
    ap.add_argument("--tasks", default="qa1,arith,twohop")
    ap.add_argument("--layout", default="prefix", choices=LAYOUTS)
    ap.add_argument("--selectors", default="attention,attention-deviation,influence,cacheblend,random")
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--requests", type=_positive_int, default=100)
    args = ap.parse_args()
    selectors = args.selectors.split(",")
    if bad := [s for s in selectors if s not in SELECTORS]:
        ap.error(f"unknown selector {bad[0]!r}; known: {', '.join(SELECTORS)}")
    if not 0.0 < args.ratio <= 1.0:
        ap.error(f"--ratio must be in (0, 1], got {args.ratio}")
    llm = open_llm(ap, args.model)
    if llm.model.shifted_logits or llm.model.config.block_size is not None:
        ap.error(f"{args.model}: a {llm.model.family} model recomputes affix columns beside the request's own; "
                 "this script builds LLaDA's admission context only")
    print(f"| task | {' | '.join(selectors)} |")
    print("|---|" + "---:|" * len(selectors))
    for task in parse_tasks(args.tasks):
        exs = held_out(task, args.requests, 6, 0)
        shares = dict.fromkeys(selectors, 0.0)
        with torch.inference_mode():
            for prompt in task_prompts(llm, exs, args.layout):
                oracle = make_selector("kv-deviation").select(admission_context(llm, prompt, answer_length(task)),
                                                              args.ratio)
                for s in selectors:
                    got = make_selector(s).select(admission_context(llm, prompt, answer_length(task)), args.ratio)
                    shares[s] += float((got & oracle).sum() / oracle.sum()) / len(exs)
        print(f"| {task} | " + " | ".join(f"{100 * v:.0f}%" for v in shares.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
