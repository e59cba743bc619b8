"""Separate against fused q/k/v and gate/up projections in the engine, on the shipped model's task workload.

Two copies of the model, one kept unfused, each run in both modes (dual cache, ACache) through ``acache bench``'s
driver (a fresh engine, the shared affix already cached); the four runs take turns, round after round, and the
median time a batch is printed. Run from the repository root:

    python -m acache_lab.probes.fused_tiny_ab --batch 1
"""

from __future__ import annotations

import argparse
import statistics

import torch

from acache.cli import _positive_int
from acache.models.loader import load_model
from acache_lab.bench.engine import make_task_requests, run_mode

MODEL = "models/acache-tiny"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=_positive_int, default=1)
    ap.add_argument("--rounds", type=_positive_int, default=15)
    args = ap.parse_args()
    separate = load_model(MODEL, dtype="bfloat16")
    separate.fuse_projections = lambda: None  # this copy stays unfused when its engines are built
    fused = load_model(MODEL, dtype="bfloat16")
    prompts, w = make_task_requests(MODEL, args.batch, 8, 0)

    batches = max(1, 40 // args.batch)  # batches a run, so each run takes a similar time at every size
    models = (("separate", separate), ("fused", fused))
    runs = [(name, model, reuse) for name, model in models for reuse in (False, True)]
    times: dict[tuple[str, bool], list[float]] = {(name, reuse): [] for name, _, reuse in runs}
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):  # the first round is untimed
            for name, model, reuse in runs:
                result = run_mode(model, prompts * batches, w, reuse, args.batch, 16, 64 << 20)
                if round_:
                    times[(name, reuse)].append(result.wall_time_s / batches)
    assert fused.layers[0].qkv is not None and separate.layers[0].qkv is None
    for reuse in (False, True):
        a, b = (statistics.median(times[(name, reuse)]) for name in ("separate", "fused"))
        print(f"batch {args.batch} {'acache' if reuse else 'dual'}: separate {a * 1e3:.2f} ms, "
              f"fused {b * 1e3:.2f} ms a batch ({a / b:.2f}x)")


if __name__ == "__main__":
    main()
