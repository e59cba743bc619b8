"""ACache alone on the engine benchmark's workload at one batch: wall, refresh, in-block and selection seconds.

Selection is timed where it runs: ``selecting_refresh_s``, the first refreshes that chose anchors inside them (one
pass, the default; part of ``recompute_s``), and ``selection_s``, selection steps of their own (two pass; 0 here).

The same driver as ``acache bench`` (``run_mode``: a fresh engine, the shared affix already cached), without the
dual cache beside it, so one checkout against another can be timed in short alternating runs. Run it from
another checkout's root with ``PYTHONPATH=.`` to time that code:

    python -m acache_lab.probes.engine_phases --batch 16 --gen-length 256
"""

from __future__ import annotations

import argparse
import json

import torch

from acache.cli import _positive_int
from acache_lab.bench.decode import random_model
from acache_lab.bench.engine import SMOL_SHAPE, Workload, make_requests, run_mode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=_positive_int, default=16)
    ap.add_argument("--gen-length", type=int, default=256, help="a multiple of the 32-token block")
    ap.add_argument("--repeats", type=_positive_int, default=1)
    args = ap.parse_args()
    if args.gen_length <= 0 or args.gen_length % 32:
        raise SystemExit(f"--gen-length must be a positive multiple of 32, not {args.gen_length}")
    torch.manual_seed(0)
    model = random_model("llada", SMOL_SHAPE, torch.bfloat16, torch.device("cpu"))
    w = Workload(700, 60, args.gen_length, 32, args.gen_length // 4, 0.2)
    prompts = make_requests(model, w, args.batch, 0)
    with torch.inference_mode():
        run_mode(model, prompts[:2], w, True, 2, 16, 1 << 30)  # untimed: lazy initialisation
        for _ in range(args.repeats):
            r = run_mode(model, prompts, w, True, args.batch, 16, 1 << 30)
            print(json.dumps({"batch": args.batch, "wall_s": round(r.wall_time_s, 2),
                              "recompute_s": round(r.recompute_latency_s, 2), "in_block_s": round(r.step_time_s, 2),
                              "selecting_refresh_s": round(r.selecting_refresh_s, 2),
                              "selection_s": round(r.selection_time_s, 2)}), flush=True)


if __name__ == "__main__":
    main()
