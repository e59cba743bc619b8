"""What choosing anchors costs, in forwards: inside the first refresh (one pass) against a pass of its own.

The engine benchmark's workload (SmolLM2-135M shape, random weights, bfloat16, 700-token shared affix, 60-token
questions, 256 masks) is admitted at ``--batch`` on fresh engines with the affix cached, and each engine's first
steps are timed: the dual cache's first refresh (a forward of every request's whole canvas), the one-pass
engine's first refresh (which selects), and the two-pass engine's selection and then its first refresh (the
anchors fixed). Every engine is fresh, so each first refresh writes into pages touched for the first time alike.
Selection's own cost is then, over the dual refresh: one pass, its refresh minus the two-pass refresh; two pass,
its selection. Medians of ``--repeats``, interleaved.

    python -m acache_lab.probes.one_pass_cost --batch 16 --anchor-depth 0.25 [--device cuda]

``--anchor-depth`` d times a third engine beside them: one pass scoring through the first ``d`` of the layers.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import torch

from acache.cli import _positive_int
from acache.policies import ONE_PASS_SELECTORS
from acache_lab.bench.decode import random_model
from acache_lab.bench.engine import SMOL_SHAPE, Workload, admitted_engine, make_requests, timed_steps, workload_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=_positive_int, default=16)
    parser.add_argument("--repeats", type=_positive_int, default=3)
    parser.add_argument("--selector", default="attention", choices=ONE_PASS_SELECTORS,
                        help="a selector with both forms (the others choose at admission or in a pass of their own)")
    parser.add_argument("--anchor-depth", type=float, default=None, help="also time one pass at this depth")
    parser.add_argument("--device", default="cpu", help="where the random model runs (cpu, cuda)")
    args = parser.parse_args()
    if args.anchor_depth is not None and not 0 < args.anchor_depth <= 1:
        parser.error(f"--anchor-depth must be in (0, 1], got {args.anchor_depth}")
    model = random_model("llada", SMOL_SHAPE, torch.bfloat16, torch.device(args.device), 0)
    model.fuse_projections()
    w = Workload(selector=args.selector, anchor_pass="one")
    prompts = make_requests(model, w, args.batch, 1)
    one, two = workload_params(w, True), workload_params(Workload(selector=args.selector, anchor_pass="two"), True)
    timed_steps(admitted_engine(model, prompts[:1], one), 2)  # warm-up
    shallow = replace(one, anchor_depth=args.anchor_depth) if args.anchor_depth is not None else None
    runs: dict[str, list[float]] = {"dual": [], "one": [], "two select": [], "two refresh": [], "depth": []}
    for _ in range(args.repeats):
        runs["dual"].append(timed_steps(admitted_engine(model, prompts, workload_params(w, False)), 1)[0])
        runs["one"].append(timed_steps(admitted_engine(model, prompts, one), 1)[0])
        if shallow is not None:
            runs["depth"].append(timed_steps(admitted_engine(model, prompts, shallow), 1)[0])
        select, refresh = timed_steps(admitted_engine(model, prompts, two), 2)
        runs["two select"].append(select)
        runs["two refresh"].append(refresh)
    med = {k: statistics.median(v) for k, v in runs.items() if v}
    print(f"batch {args.batch}, selector {args.selector}, median of {args.repeats}: dual refresh {med['dual']:.3f} s; "
          f"one-pass refresh {med['one']:.3f} s; two-pass selection {med['two select']:.3f} s + refresh "
          f"{med['two refresh']:.3f} s" + (f"; one pass at depth {shallow.anchor_depth} {med['depth']:.3f} s"
                                            if shallow is not None else ""))
    print(f"selection's own cost in forwards: one pass {(med['one'] - med['two refresh']) / med['dual']:.3f}, "
          f"two pass {med['two select'] / med['dual']:.3f}; first refresh, selection included: one pass "
          f"{med['one'] / med['dual']:.3f}, two pass {(med['two select'] + med['two refresh']) / med['dual']:.3f}")
    if shallow is not None:
        print(f"at depth {shallow.anchor_depth}: selection's own cost "
              f"{(med['depth'] - med['two refresh']) / med['dual']:.3f} of a forward, its first refresh "
              f"{med['depth'] / med['dual']:.3f}")


if __name__ == "__main__":
    main()
