"""A/B of five speed-ups on the engine benchmark's shapes, interleaved in one process, medians reported.

1. Attention with an all-True key mask against attention with no mask (what ``dense_mask`` passes when every
   key is valid), at a refresh's shape and at an in-block step's.
2. An in-block step of a batch: the step key sets stacked afresh and the block's keys concatenated to them at
   every layer (the code before), against the batch's stack kept from step to step with room for the block's
   keys, written in place (``StepKeyCache.stacked``). Both give the same states (tests/engine/test_step_keys.py).
3. A step's greedy proposals, one request's ``[1, 32, vocab]`` block logits at a time as the runner does:
   ``argmax`` against ``max(...).indices`` (the same first maximum, tests/decoding/test_commit.py).
4. A step's proposals with their confidences, as ``propose`` computes them: the written-out definition (the
   whole log-softmax, ``[MASK]`` filled with -inf in a copy of the logits) against ``logsumexp`` and a second
   look only where ``[MASK]`` was the maximum (the same tokens, confidences within 1e-7,
   tests/decoding/test_commit.py).
5. Whole forwards with the q/k/v and gate/up projections separate against fused
   (``DiffusionLM.fuse_projections``: the same states to the bit, tests/models/test_fused_projections.py): a
   refresh of every column with no cache, and an in-block step against the kept stack.

The figures in BENCHMARKS.md ("How close to the machine") come from:

    python -m acache_lab.probes.step_paths_ab
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch

from acache.cli import _positive_int
from acache.decoding.sampler import propose
from acache.engine.page_pool import PagePool
from acache.engine.step_keys import StackedKV, StepKeyCache
from acache.models.layers import attend
from acache_lab.bench.decode import random_model
from acache_lab.bench.engine import SMOL_SHAPE


def interleaved(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each case, the cases run in turn ``repeats`` times after one untimed round."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(repeats + 1):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def written_out_proposals(logits: torch.Tensor, mask: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy proposals as the definition reads: ``[MASK]`` filled out of a copy, ``p(x0)`` from the log-softmax."""
    log_probs = logits.log_softmax(-1)
    x0 = logits.index_fill(-1, torch.tensor([mask]), float("-inf")).max(-1).indices
    return x0, log_probs.gather(-1, x0[..., None]).squeeze(-1).exp()


def report(title: str, medians: dict[str, float]) -> None:
    (a, ta), (b, tb) = medians.items()
    print(f"{title}: {a} {ta * 1e3:.1f} ms, {b} {tb * 1e3:.1f} ms ({ta / tb:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=_positive_int, default=16)
    ap.add_argument("--repeats", type=_positive_int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    b, cached, block = args.batch, 984, 32  # the bench: 700 affix + 60 question + 256 generated, blocks of 32
    model = random_model("llada", SMOL_SHAPE, torch.bfloat16, torch.device("cpu"))
    cfg = model.config
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    with torch.inference_mode():
        for name, tq, s in (("refresh", cached + block, cached + block), ("in-block step", block, cached + block)):
            q = torch.randn(b, tq, heads, d, dtype=torch.bfloat16)
            k, v = (torch.randn(b, s, kv_heads, d, dtype=torch.bfloat16) for _ in range(2))
            full = torch.ones(b, s, dtype=torch.bool)
            report(f"attention, {name} shape (batch {b}, {tq} queries, {s} keys)", interleaved(
                {"all-True mask": lambda q=q, k=k, v=v, m=full: attend(q, k, v, m),
                 "no mask": lambda q=q, k=k, v=v: attend(q, k, v, None)}, args.repeats))
        logits = [torch.randn(1, block, cfg.vocab_size) for _ in range(b)]
        report(f"greedy proposals of a step ({b} requests x {block} x {cfg.vocab_size} logits)", interleaved(
            {"argmax": lambda: [x.argmax(-1) for x in logits],
             "max().indices": lambda: [x.max(-1).indices for x in logits]}, args.repeats))
        mask, hidden = cfg.mask_token_id, torch.randn(b, block, cfg.hidden_size, dtype=torch.bfloat16)

        def step_proposals(rule: Callable[[torch.Tensor], object]) -> list[object]:
            logits = model.logits(hidden)  # fresh each step, as in the engine: fp32 [B, 32, V]
            return [rule(logits[i:i + 1]) for i in range(b)]

        report(f"a step's LM head, proposals and confidences ({b} requests x {block} x {cfg.vocab_size})",
               interleaved({"log-softmax, [MASK] filled": lambda: step_proposals(
                               lambda x: written_out_proposals(x, mask)),
                            "logsumexp, second look": lambda: step_proposals(
                               lambda x: propose(x, 0.0, mask_token_id=mask))}, args.repeats))
        pool = PagePool(cfg, 16, -(-b * cached // 16) + 1, torch.bfloat16, torch.device("cpu"))
        for t in (*pool.keys, *pool.values):
            t.copy_(torch.randn(t.shape))
        keys = StepKeyCache(pool, d, cfg.rope_theta)
        ids = [str(i) for i in range(b)]
        sets = [keys.get(i, 1, torch.arange(n * cached, (n + 1) * cached), torch.arange(cached))
                for n, i in enumerate(ids)]
        tokens = torch.randint(0, 1000, (b, block))
        positions = torch.arange(cached, cached + block).expand(b, -1)
        dev = torch.device("cpu")
        report(f"in-block step, the whole model (batch {b}, {block} fed, {cached} cached)", interleaved(
            {"fresh stack + concatenation": lambda: model(tokens, positions, past=StackedKV(sets, dev)),
             "kept stack + room": lambda: model(tokens, positions, past=keys.stacked(ids, sets, block, dev))},
            args.repeats))
        fused = copy.deepcopy(model)
        fused.fuse_projections()
        canvas = torch.randint(0, 1000, (b, cached + block))
        everywhere = torch.arange(cached + block).expand(b, -1)
        report(f"a refresh with no cache, the whole model (batch {b}, {cached + block} fed)", interleaved(
            {"separate projections": lambda: model(canvas, everywhere),
             "fused projections": lambda: fused(canvas, everywhere)}, args.repeats))
        report(f"in-block step, the whole model (batch {b}, {block} fed, {cached} cached)", interleaved(
            {"separate projections": lambda: model(tokens, positions, past=keys.stacked(ids, sets, block, dev)),
             "fused projections": lambda: fused(tokens, positions, past=keys.stacked(ids, sets, block, dev))},
            args.repeats))


if __name__ == "__main__":
    main()
