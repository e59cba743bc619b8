"""``acache bench context``: one in-block step's latency and the cache's size against context length, for the
block-diffusion family with attention (Fast-dLLM v2's layout: a K/V cache of every earlier token) and with
the state-space mixer (a state after the finished blocks), at the same width and depth.

Each point times a step that denoises one block of ``block`` masks after ``L`` context tokens: attention
against a cache of ``L`` keys and values (already rotated, as the engine keeps them for in-block steps), the
state-space model from its state. The caches are filled with random values of their real shapes and dtype:
a step's cost does not depend on the values, and building a 64k-token cache by prefill is not what is
measured. Memory is the cache's own bytes.

With ``--serve N`` the same two models also serve ``N`` requests of each length through the engine, under one
cache budget: the paged pool for attention, the per-request states for the state-space variant. The engine
admits what the budget holds, so a constant-size cache is what lets the batch grow with the context.
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
from acache.models.checkpoint import init_random_, random_config
from acache.models.fast_dllm_v2 import FastDLLMv2Model
from acache.models.kv import KVCache
from acache.models.loader import parse_device, parse_dtype
from acache.models.ssm import SSMBlockDiffusionLM, SSMConfig, init_scan_model_
from acache.sampling_params import SamplingParams

VOCAB = 32000


@dataclass
class ContextPoint:
    variant: str  # "attention" or "state-space"
    context: int
    step_ms: float  # median over the repeats
    cache_mib: float


def models(hidden: int, layers: int, heads: int, block: int, state: int, dtype: torch.dtype,
           device: torch.device) -> tuple[FastDLLMv2Model, SSMBlockDiffusionLM]:
    """The two variants at one width: attention heads of ``hidden / heads``; the mixer at twice the width
    (Mamba's expansion) in heads of 64 channels and a state of ``state`` per channel."""
    cfg = random_config("fast_dllm_v2", VOCAB, VOCAB - 1, VOCAB - 2, layers=layers, hidden_size=hidden, heads=heads,
                        block_size=block, max_seq_len=1 << 20)
    attention = FastDLLMv2Model(cfg)
    init_random_(attention, 0)
    ssm = SSMBlockDiffusionLM(SSMConfig(VOCAB, hidden, layers, 4 * hidden, max(1, 2 * hidden // 64), 64, state,
                                        block, VOCAB - 1, VOCAB - 2, max_position_embeddings=1 << 20))
    init_scan_model_(ssm, 0)
    return (attention.to(device, dtype).eval().requires_grad_(False),
            ssm.to(device, dtype).eval().requires_grad_(False))


def _median_ms(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def measure(attention: FastDLLMv2Model, ssm: SSMBlockDiffusionLM, context: int, repeats: int,
            seed: int = 0) -> list[ContextPoint]:
    cfg, device, dtype = attention.config, attention.device, attention.dtype
    block = cfg.block_size
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, VOCAB - 2, (1, block), generator=g, device=device)
    positions = torch.arange(context, context + block, device=device)[None]
    shape = (1, context, cfg.num_kv_heads, cfg.head_dim)
    keys = [torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
    values = [torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
    past = KVCache(keys, values, torch.arange(context, device=device)[None],
                   torch.ones(1, context, dtype=torch.bool, device=device), rotated=True)
    kv_bytes = sum(t.numel() * t.element_size() for t in (*keys, *values))
    # both steps end in the vocabulary head, as a decoding step does (the state-space step always did; the
    # attention step stopped at the last hidden states, which left the head's matmul out of one side only)
    attention_ms = _median_ms(lambda: attention.logits(attention(ids, positions, past=past).hidden), repeats,
                              device)
    state = [tuple(torch.randn(t.shape, generator=g, device=device, dtype=t.dtype) for t in layer)
             for layer in ssm.empty_state()]
    ssm_ms = _median_ms(lambda: ssm(ids, state), repeats, device)
    return [ContextPoint("attention", context, attention_ms, kv_bytes / 2**20),
            ContextPoint("state-space", context, ssm_ms, ssm.state_bytes(state) / 2**20)]


@dataclass
class ServePoint:
    variant: str
    context: int
    requests: int
    most_at_once: int  # the largest batch a request ran in
    peak_cache_mib: float
    wall_s: float
    tokens_per_s: float  # generated tokens over the wall time


def serve(model: FastDLLMv2Model | SSMBlockDiffusionLM, variant: str, context: int, requests: int, budget: int,
          seed: int = 0) -> ServePoint:
    """``requests`` prompts of ``context`` random tokens, each generating one block, all queued at once on an
    engine whose cache holds ``budget`` bytes."""
    block = model.config.block_size
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=budget, max_num_seqs=requests,
                                           max_model_len=context + block))
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(gen_length=block, block_length=block, threshold=0.9)
    engine.reset_metrics()
    t0 = time.perf_counter()
    for _ in range(requests):
        engine.add_request(torch.randint(0, VOCAB - 2, (context,), generator=g).tolist(), params)
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    wall = time.perf_counter() - t0
    summary = engine.summary()
    failed = [o.error for o in done if o.error]
    if failed:
        raise RuntimeError(f"a benchmark request failed: {failed[0]}")
    return ServePoint(variant, context, requests, max(o.stats.max_batch for o in done),
                      summary["peak_kv_bytes"] / 2**20, wall, sum(len(o.token_ids) for o in done) / wall)


def serve_markdown(points: list[ServePoint], budget_mib: float) -> str:
    lines = [f"| context | variant | requests | most at once | peak cache MiB (budget {budget_mib:g}) | wall s | "
             "tokens/s |", "|---:|---|---:|---:|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {p.context:,} | {p.variant} | {p.requests} | {p.most_at_once} | {p.peak_cache_mib:.1f} | "
                     f"{p.wall_s:.2f} | {p.tokens_per_s:.1f} |")
    return "\n".join(lines)


def markdown(points: list[ContextPoint]) -> str:
    contexts = sorted({p.context for p in points})
    by = {(p.variant, p.context): p for p in points}
    lines = ["| context | attention step ms | state-space step ms | attention cache MiB | state-space cache MiB |",
             "|---:|---:|---:|---:|---:|"]
    for c in contexts:
        a, s = by[("attention", c)], by[("state-space", c)]
        lines.append(f"| {c:,} | {a.step_ms:.2f} | {s.step_ms:.2f} | {a.cache_mib:.1f} | {s.cache_mib:.2f} |")
    return "\n".join(lines)


def plot(points: list[ContextPoint], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for variant, marker in (("attention", "o"), ("state-space", "s")):
        mine = sorted((p for p in points if p.variant == variant), key=lambda p: p.context)
        xs = [p.context for p in mine]
        axes[0].plot(xs, [p.step_ms for p in mine], marker=marker, label=variant)
        axes[1].plot(xs, [p.cache_mib for p in mine], marker=marker, label=variant)
    for ax, label in zip(axes, ("one in-block step (ms)", "cache (MiB)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Block diffusion: attention cache vs state-space cache")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(args) -> int:
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(n <= 0 for n in lengths) or args.repeats < 1:
        raise ValueError("--lengths must be positive token counts and --repeats at least 1")
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    attention, ssm = models(args.hidden_size, args.layers, args.heads, args.block_length, args.state_size, dtype,
                            device)
    points: list[ContextPoint] = []
    for n in tqdm(lengths, desc="bench context", unit="length"):
        points += measure(attention, ssm, n, args.repeats, args.seed)
    header = (f"block diffusion at hidden {args.hidden_size}, {args.layers} layers, {args.heads} attention heads, "
              f"state {args.state_size}, blocks of {args.block_length}; {dtype}, {device}; torch "
              f"{torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}; median of "
              f"{args.repeats} step(s) a point after a warm-up")
    print(header)
    print(markdown(points))
    served: list[ServePoint] = []
    if args.serve:
        budget = int(args.cache_budget_mib * 2**20)
        serve_lengths = [int(x) for x in args.serve_lengths.split(",")]
        for n in tqdm(serve_lengths, desc="bench context --serve", unit="length"):
            served += [serve(attention, "attention", n, args.serve, budget, args.seed),
                       serve(ssm, "state-space", n, args.serve, budget, args.seed)]
        print(f"\n{args.serve} requests of each length queued at once, one block of {args.block_length} "
              f"generated each, cache budget {args.cache_budget_mib:g} MiB:")
        print(serve_markdown(served, args.cache_budget_mib))
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": header, "points": [asdict(p) for p in points],
                                               "served": [asdict(p) for p in served]}, indent=2) + "\n")
    if args.plot and plot(points, Path(args.plot)):
        print(f"plot: {args.plot}")
    return 0
