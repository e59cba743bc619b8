"""Where anchor selection's time goes: the probe forward and the attention-mass score, at one batch.

The engine benchmark's workload (SmolLM2-135M shape, random weights, bfloat16, 700-token shared affix, 60-token
questions, 256 masks), its anchors chosen in a pass of their own (``anchor_pass="two"``: one pass chooses inside
the first refresh, where none of the functions below run), is admitted at ``--batch``; each repeat builds a fresh
engine with the affix cached and runs its first step, which selects every request's anchors in one batch. The probe
(``_run_probe``), the score (``attention_mass``) and the whole selection (``ModelRunner._select``) are timed by
wrapping them, and the median of the repeats is printed. Run it from another checkout's root with ``PYTHONPATH=.``
to time that code (the names it wraps are the same since the score landed):

    python -m acache_lab.probes.selection_time --batch 16
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from acache.affix.context import SelectionContext
from acache.cli import _positive_int
from acache.engine.llm_engine import EngineConfig, LLMEngine
from acache.engine.model_runner import ModelRunner
from acache_lab.bench.decode import random_model
from acache_lab.bench.engine import SMOL_SHAPE, Workload, make_requests, workload_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=_positive_int, default=16)
    ap.add_argument("--repeats", type=_positive_int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = random_model("llada", SMOL_SHAPE, torch.bfloat16, torch.device("cpu"))
    w = Workload(700, 60, 256, 32, 64, 0.2, anchor_pass="two")
    prompts = make_requests(model, w, args.batch, 0)
    spent: dict[str, float] = {}

    def timed(owner: type, name: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

        setattr(owner, name, wrapper)

    for owner, name in ((SelectionContext, "_run_probe"), (SelectionContext, "attention_mass"),
                        *(((SelectionContext, "affix_keys"),) if hasattr(SelectionContext, "affix_keys") else ()),
                        (ModelRunner, "_select")):
        timed(owner, name)

    def once() -> dict[str, float]:
        engine = LLMEngine(model, EngineConfig(page_size=16, kv_cache_memory=1 << 30, max_num_seqs=args.batch,
                                               max_num_batched_tokens=16384))
        shared, _ = engine.affixes.acquire(prompts[0].affix_ids(prompts[0].affixes[0]), "shots")
        engine.affixes.release(shared)
        for p in prompts:
            engine.add_request(p, workload_params(w, True))
        spent.clear()
        engine.step()
        return dict(spent)

    runs = []
    with torch.inference_mode():
        once()  # untimed: lazy initialisation
        runs = [once() for _ in range(args.repeats)]
    if not runs[0]:
        raise SystemExit("nothing was timed: the engine's first step ran none of the functions this probe wraps")
    medians = {name: round(statistics.median(r[name] for r in runs), 3) for name in runs[0]}
    print(json.dumps({"batch": args.batch, "repeats": args.repeats, "seconds": medians}))


if __name__ == "__main__":
    main()
