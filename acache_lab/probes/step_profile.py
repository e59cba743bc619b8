"""Where an engine step's time goes: the dual cache's and ACache's first refresh and in-block steps, profiled.

The engine benchmark's workload (random weights, 700-token shared affix, 60-token questions, 256 masks) is
admitted at ``--batch`` on fresh engines with the affix cached. For each mode the probe times the first step
(the first refresh: ACache's is the selecting one) and the next ``--block-steps`` (in-block), then profiles the
same steps of another fresh engine and prints, per step kind, the operators that took most time (device time on
a GPU, CPU time otherwise) and the host's reads of device values (``aten::_local_scalar_dense``, ``aten::nonzero``):
at each, a host that launches a small model's kernels faster than they run stops until the device catches up.

    python -m acache_lab.probes.step_profile --device cuda --shape llada-8b --batch 16
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from acache.cli import _non_negative_int, _positive_int
from acache_lab.bench.decode import random_model
from acache_lab.bench.engine import SHAPES, Workload, admitted_engine, make_requests, timed_steps, workload_params

#: operators whose every call reads a device value on the host, and so waits for the device
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::item")


def model_pool_bytes(model, batch: int) -> int:
    """Room for ``batch`` requests of about 1,100 columns each, and the shared affix."""
    cfg = model.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
    return per_token * 1200 * (batch + 1)


def table(prof, on_device: bool, rows: int) -> str:
    key = "self_cuda_time_total" if on_device else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=48)


def host_reads(prof) -> dict[str, int]:
    return {e.key: e.count for e in prof.key_averages() if e.key in HOST_READS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--batch", type=_positive_int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--block-steps", type=_positive_int, default=3, help="in-block steps timed after the first refresh")
    ap.add_argument("--repeats", type=_positive_int, default=3, help="fresh engines timed per mode (medians)")
    ap.add_argument("--rows", type=_non_negative_int, default=18, help="operators listed per profile")
    ap.add_argument("--modes", default="dual,acache", help="which engines, in order (dual, acache)")
    ap.add_argument("--reuse-step-keys", choices=["default", "on", "off"], default="default",
                    help="the engine's reuse_step_keys (default: on for CPU only)")
    args = ap.parse_args()
    device = torch.device(args.device)
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not names or any(m not in ("dual", "acache") for m in names):  # before the model is built (8B at llada-8b)
        raise SystemExit(f"--modes takes dual and/or acache, comma-separated, not {args.modes!r}")
    reuse = {"default": None, "on": True, "off": False}[args.reuse_step_keys]
    model = random_model("llada", SHAPES[args.shape], torch.bfloat16, device, 0)
    config = {"kv_cache_memory": model_pool_bytes(model, args.batch), "reuse_step_keys": reuse}
    model.fuse_projections()
    w = Workload(selector="attention")
    prompts = make_requests(model, w, args.batch, 1)
    known = {"dual": workload_params(w, False), "acache": workload_params(w, True)}
    modes = {m: known[m] for m in names}
    for params in modes.values():  # warm-up
        timed_steps(admitted_engine(model, prompts[:1], params, **config), 2)
    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    print(f"shape {args.shape}, batch {args.batch}, {device}, reuse_step_keys {args.reuse_step_keys}")
    # every mode timed before any is profiled: a CUDA profile can leave the device's tracing on and slow what
    # runs after it in the process
    timings = {name: [timed_steps(admitted_engine(model, prompts, params, **config), 1 + args.block_steps)
                      for _ in range(args.repeats)] for name, params in modes.items()}
    for name, params in modes.items():
        runs = timings[name]
        first = statistics.median(r[0] for r in runs)
        block = statistics.median(t for r in runs for t in r[1:])
        print(f"\n=== {name}: first refresh {first * 1e3:.1f} ms, in-block step {block * 1e3:.1f} ms "
              f"(medians of {args.repeats} fresh engines)")
        engine = admitted_engine(model, prompts, params, **config)
        for kind, steps in (("first refresh", 1), ("in-block steps", args.block_steps)):
            with profile(activities=activities) as prof:
                timed_steps(engine, steps)
            print(f"\n--- {name}, {kind} ({steps}): host reads {host_reads(prof)}")
            print(table(prof, on_device, args.rows))


if __name__ == "__main__":
    main()
