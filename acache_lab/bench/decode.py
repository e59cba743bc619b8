"""``acache bench decode``: generated tokens/s of one model under each intra-request cache policy.

All policies run side by side in one process, interleaved repeat by repeat, so machine noise hits
them alike; the table reports medians and each policy's speed-up over no cache.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from acache.engine import EngineConfig, LLMEngine
from acache.engine.page_pool import page_bytes
from acache.models.base import DiffusionLM
from acache.models.checkpoint import init_random_, random_config
from acache.models.loader import load_model, parse_device, parse_dtype
from acache.models.registry import family_class
from acache.sampling_params import SamplingParams

# A LLaDA-shaped model of about 100M parameters: 12 layers, hidden 768, 12 heads, MLP 2048, vocab 8192.
DEFAULT_SHAPE = {"layers": 12, "hidden_size": 768, "heads": 12, "intermediate_size": 2048, "vocab_size": 8192}


@dataclass
class DecodeBenchRow:
    cache: str
    tokens_per_s: float
    wall_time_s: float
    forward_time_s: float
    nfe: int
    refreshes: int
    speedup: float


def random_model(family: str, shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0) -> DiffusionLM:
    cls = family_class(family)
    vocab = shape["vocab_size"]
    config = random_config(cls.family, vocab, mask_token_id=vocab - 1, eos_token_id=vocab - 2,
                           layers=shape["layers"], hidden_size=shape["hidden_size"], heads=shape["heads"],
                           kv_heads=shape.get("kv_heads"), intermediate_size=shape["intermediate_size"])
    with torch.device(device):  # built where it runs: an 8B shape never passes through host memory whole
        model = cls(config).to(dtype)
    init_random_(model, seed)
    return model.eval().requires_grad_(False)


def _decode(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, int]:
    """Runs ``prompts`` to completion on ``engine``; returns forward time, NFE and refreshes per request."""
    engine.reset_metrics()
    for p in prompts:
        engine.add_request(p, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    m = engine.metrics
    return m.refresh_times.total_s + m.step_times.total_s, max(o.nfe for o in outs), max(o.refreshes for o in outs)


def run_decode_bench(model: DiffusionLM, prompt_length: int, params_by_cache: dict[str, SamplingParams],
                     repeats: int, batch_size: int = 1, seed: int = 0) -> list[DecodeBenchRow]:
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    special = {model.config.mask_token_id, model.config.eos_token_id}
    prompts = []
    for _ in range(batch_size):
        ids = torch.randint(0, vocab, (prompt_length,), generator=gen).tolist()
        prompts.append([t if t not in special else 0 for t in ids])
    longest = max(p.gen_length for p in params_by_cache.values())
    page = 16
    kv_bytes = (batch_size * (-(-(prompt_length + longest) // page)) + 1) * page_bytes(model.config, page, model.dtype)
    engine = LLMEngine(model, EngineConfig(page_size=page, kv_cache_memory=kv_bytes, max_num_seqs=batch_size))
    _decode(engine, prompts, SamplingParams(gen_length=32, block_length=32))  # warm-up
    samples: dict[str, list] = {c: [] for c in params_by_cache}
    with tqdm(total=repeats * len(params_by_cache), desc="bench decode", unit="run") as bar:
        for _ in range(repeats):
            for cache, params in params_by_cache.items():
                t0 = time.perf_counter()
                stats = _decode(engine, prompts, params)
                samples[cache].append((time.perf_counter() - t0, *stats))
                bar.update(1)
    rows = []
    for cache, runs in samples.items():
        wall = statistics.median(r[0] for r in runs)
        fwd = statistics.median(r[1] for r in runs)
        tokens = params_by_cache[cache].gen_length * batch_size
        rows.append(DecodeBenchRow(cache, tokens / wall, wall, fwd, runs[0][2], runs[0][3], 0.0))
    base = next((r for r in rows if r.cache == "none"), rows[0])
    for r in rows:
        r.speedup = r.tokens_per_s / base.tokens_per_s
    return rows


def markdown_table(rows: list[DecodeBenchRow]) -> str:
    base = next((r.cache for r in rows if r.cache == "none"), rows[0].cache if rows else "none")
    lines = [f"| cache | tokens/s | wall s | forward s | NFE | refreshes | speed-up vs {base} |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.cache} | {r.tokens_per_s:.2f} | {r.wall_time_s:.2f} | {r.forward_time_s:.2f} | "
                     f"{r.nfe} | {r.refreshes} | {r.speedup:.2f}x |")
    return "\n".join(lines)


def main(args) -> int:
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    if not caches:
        raise ValueError("--caches names none: give some of none, prefix, dual, comma-separated")
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    torch.manual_seed(args.seed)
    if args.model:
        if args.family is not None:
            raise ValueError("--family picks the random model's family; --model's own config says its family")
        model = load_model(args.model, dtype=args.dtype, device=device)
        described = str(args.model)
    else:
        shape = dict(DEFAULT_SHAPE)
        family = args.family or "llada"
        model = random_model(family, shape, dtype, device, args.seed)
        described = f"random {family} " + ", ".join(f"{k}={v}" for k, v in shape.items())
    n_params = sum(p.numel() for p in model.parameters())
    params = {c: SamplingParams(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                                remasking="low_confidence", cache=c, ignore_eos=True) for c in caches}
    rows = run_decode_bench(model, args.prompt_length, params, args.repeats, args.batch_size, args.seed)
    header = (f"model: {described} ({n_params / 1e6:.1f}M parameters), {model.dtype}, {device}; "
              f"prompt {args.prompt_length}, gen {args.gen_length}, block {args.block_length}, "
              f"steps {params[caches[0]].steps_per_block * params[caches[0]].num_blocks} (low-confidence), "
              f"batch {args.batch_size}, median of {args.repeats}; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(header)
    print(markdown_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": header, "rows": [asdict(r) for r in rows]}, indent=2))
    return 0
