"""Separate against fused q/k/v and gate/up projections in the engine, on the shipped model's task workload.

Two copies of the model, one kept unfused, each with an engine per mode (dual cache, ACache), the shared affix
already cached; the four engines run the same requests in turn, round after round, and the median time a batch
is printed. Run from the repository root:

    python scripts/fused_tiny_ab.py --batch 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from acache.engine import EngineConfig, LLMEngine
from acache.models.loader import load_model
from acache_lab.bench.engine import make_task_requests, workload_params

MODEL = "models/acache-tiny"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    separate = load_model(MODEL, dtype="bfloat16")
    separate.fuse_projections = lambda: None  # this copy stays unfused when its engines are built
    fused = load_model(MODEL, dtype="bfloat16")
    prompts, w = make_task_requests(MODEL, args.batch, 8, 0)

    def engine(model) -> LLMEngine:
        e = LLMEngine(model, EngineConfig(page_size=16, kv_cache_memory=64 << 20, max_num_seqs=args.batch))
        shared, _ = e.affixes.acquire(prompts[0].affix_ids(prompts[0].affixes[0]), "shots")
        e.affixes.release(shared)
        return e

    engines = {(name, reuse): engine(model) for name, model in (("separate", separate), ("fused", fused))
               for reuse in (False, True)}
    assert fused.layers[0].qkv is not None and separate.layers[0].qkv is None
    batches = max(1, 40 // args.batch)  # batches a round, so each round takes a similar time at every size
    times: dict[tuple[str, bool], list[float]] = {key: [] for key in engines}
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):  # the first round is untimed
            for (name, reuse), e in engines.items():
                params = workload_params(w, reuse)
                t0 = time.perf_counter()
                for _ in range(batches):
                    for p in prompts:
                        e.add_request(p, params)
                    while e.has_unfinished():
                        e.step()
                if round_:
                    times[(name, reuse)].append((time.perf_counter() - t0) / batches)
    for reuse in (False, True):
        a, b = (statistics.median(times[(name, reuse)]) for name in ("separate", "fused"))
        print(f"batch {args.batch} {'acache' if reuse else 'dual'}: separate {a * 1e3:.2f} ms, "
              f"fused {b * 1e3:.2f} ms a batch ({a / b:.2f}x)")


if __name__ == "__main__":
    main()
