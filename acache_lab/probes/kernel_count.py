"""What an engine step dispatches, counted on any machine: operators that do work, and views, by source line.

On a GPU a small model's step costs what the host spends launching its kernels, not what they compute (the H100
profiles in BENCHMARKS.md), so the count of operators a step dispatches (most launch one kernel there, a few none)
is a measure of its GPU cost that a CPU can take. The engine benchmark's workload (random weights, 700-token shared
affix, 60-token questions, 256 masks) is admitted at ``--batch`` on a fresh engine with the affix cached, and one
step is counted through torch's dispatch: the first refresh (``--step refresh``; ACache's is the selecting one) or
the first in-block step after it (``--step in-block``), as a GPU would run it: the engine's step keys off (their
default there) and the selection's attention mass scored in one block (a CPU scores it in cache-sized pieces).
Operators that only make a view of a tensor are counted apart; the lines dispatching most are listed.

    python -m acache_lab.probes.kernel_count --mode acache --batch 16 --layers 30
"""

from __future__ import annotations

import argparse
import collections
import traceback
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from acache.affix import context
from acache.cli import _non_negative_int, _positive_int
from acache_lab.bench.decode import random_model
from acache_lab.bench.engine import SMOL_SHAPE, Workload, admitted_engine, make_requests, workload_params

#: operators that return a view (no work, no copy)
VIEWS = frozenset({"view", "as_strided", "slice", "select", "expand", "transpose", "t", "unsqueeze", "squeeze",
                   "permute", "alias", "_unsafe_view", "reshape", "detach", "split", "split_with_sizes", "unbind",
                   "narrow", "lift_fresh", "_reshape_alias", "chunk"})


class KernelCounter(TorchDispatchMode):
    """Counts every operator dispatched inside it, by kind (one that works or a view) and, for those that work, by
    the innermost line of this project's code that called it."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: collections.Counter[str] = collections.Counter()
        self.lines: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = "views" if func.overloadpacket.__name__ in VIEWS else "operators"
        self.kinds[kind] += 1
        if kind == "operators":
            ours = [f for f in traceback.extract_stack()[:-1] if "/acache" in f.filename]
            where = f"{ours[-1].filename.rsplit('/', 2)[-2]}/{ours[-1].filename.rsplit('/', 1)[-1]}:{ours[-1].lineno}" \
                if ours else "(outside acache)"
            self.lines[where] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["dual", "acache"], default="acache")
    ap.add_argument("--step", choices=["refresh", "in-block"], default="refresh")
    ap.add_argument("--batch", type=_positive_int, default=1)
    ap.add_argument("--layers", type=_positive_int, default=SMOL_SHAPE["layers"],
                    help="the SmolLM2 shape with this depth")
    ap.add_argument("--top", type=_non_negative_int, default=15, help="source lines listed")
    args = ap.parse_args()
    if args.layers < 2:
        ap.error(f"--layers must be at least 2 (a selecting refresh filters after layer 1), got {args.layers}")
    model = random_model("llada", {**SMOL_SHAPE, "layers": args.layers}, torch.bfloat16, torch.device("cpu"), 0)
    model.fuse_projections()
    w = Workload(selector="attention")
    params = workload_params(w, args.mode == "acache")
    prompts = make_requests(model, w, args.batch, 1)
    engine = admitted_engine(model, prompts, params, reuse_step_keys=False)
    if args.step == "in-block":
        engine.step()
    counter = KernelCounter()
    with counter, mock.patch.object(context, "_CPU_SCORE_BYTES", 1 << 62):  # the mass in one block, as on a GPU
        engine.step()
    print(f"{args.mode}, {args.step}, batch {args.batch}, {args.layers} layers: {counter.kinds['operators']} "
          f"operators, {counter.kinds['views']} views, as on a GPU")
    for where, count in counter.lines.most_common(args.top):
        print(f"{count:7d}  {where}")


if __name__ == "__main__":
    main()
