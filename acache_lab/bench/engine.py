"""``acache bench`` (= ``acache bench engine``): the paper's system numbers in miniature.

The same engine runs (a) the Fast-dLLM dual cache alone, every request computing its whole prompt, and
(b) ACache, one shared copy of the affix and ``ratio`` of it recomputed per request, on the same
requests, batch size by batch size, side by side in one process. Next to each measured ratio it prints
its ideal: the token-count bound for recompute latency, the total token-passes ratio (selection probe
included) for throughput, and the page-count ratio for peak KV memory.
"""

from __future__ import annotations

import copy
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from acache.affix.prompt import AffixPrompt
from acache.affix.selectors import placed_anchor_counts
from acache.engine import EngineConfig, LLMEngine
from acache.models.base import DiffusionLM
from acache.models.loader import load_model, parse_device, parse_dtype
from acache.policies import DEFAULT_SELECTOR
from acache.sampling_params import SamplingParams
from acache_lab.bench.decode import random_model
from acache_lab.bench.fastdllm import fastdllm_generate
from acache_lab.bench.flops import FlopCounter, matmul_peak
from acache_lab.eval.cost import exact_affixes, filtering_passes, fresh_affix_columns

# LLaDA layout at SmolLM2-135M size.
SMOL_SHAPE = {"layers": 30, "hidden_size": 576, "heads": 9, "kv_heads": 3, "intermediate_size": 1536,
              "vocab_size": 49152}
# GSAI-ML/LLaDA-8B-Instruct's shape (config.json: n_layers 32, d_model 4096, n_heads 32, mlp_hidden_size 12288,
# embedding_size 126464), for the GPU run
LLADA_8B_SHAPE = {"layers": 32, "hidden_size": 4096, "heads": 32, "kv_heads": 32, "intermediate_size": 12288,
                  "vocab_size": 126464}
SHAPES = {"smollm2-135m": SMOL_SHAPE, "llada-8b": LLADA_8B_SHAPE}


@dataclass
class Workload:
    affix_len: int = 700
    question_len: int = 60
    gen_length: int = 256
    block_length: int = 32
    steps: int = 64
    ratio: float = 0.2
    selector: str = DEFAULT_SELECTOR
    anchor_pass: str | None = None  # None: the selector's default (one pass where it has one)
    exact: bool = False  # the affix is exact where it is placed (a block-causal model's prefix): no anchors taken
    fresh: int = 0  # affix columns every refresh recomputes anyway (cost.fresh_affix_columns): never anchors

    @property
    def anchors(self) -> int:
        """The affix's anchor count, as the engine counts it."""
        return placed_anchor_counts(self.ratio, self.selector, [(0, self.affix_len)], [self.exact],
                                    [self.affix_len - self.fresh])[0]

    @property
    def blocks(self) -> int:
        return self.gen_length // self.block_length

    def token_passes(self, reuse: bool, layers: int | None = None) -> float:
        """Tokens fed per request over its whole decoding (what throughput is bound by). ACache adds the selection
        probe before its refreshes; chosen in one pass (given the model's ``layers``), its first refresh is that
        forward instead (layers 0-1 on every token, then its own and the carried candidates), in tokens of a
        whole forward."""
        in_block = (self.steps - self.blocks) * self.block_length
        if not reuse:
            return self.blocks * (self.affix_len + self.question_len + self.gen_length) + in_block
        if self.anchors == 0:  # nothing to choose: every refresh is direct reuse's
            return self.blocks * self.refresh_tokens(True) + in_block
        one = layers is not None and SamplingParams(selector=self.selector, anchor_pass=self.anchor_pass,
                                                    probe_step=False).resolved_anchor_pass == "one"
        if one:
            canvas = self.affix_len + self.question_len + self.gen_length
            first = filtering_passes(self.selector, canvas, [self.affix_len], layers, self.ratio,
                                     exact=[self.exact], fresh=[self.fresh]) / layers
            return first + (self.blocks - 1) * self.refresh_tokens(True) + in_block
        probe = self.question_len + self.gen_length + self.fresh
        return probe + self.blocks * self.refresh_tokens(True) + in_block

    def refresh_tokens(self, reuse: bool) -> int:
        return (self.anchors + self.fresh if reuse else self.affix_len) + self.question_len + self.gen_length


@dataclass
class ModeResult:
    mode: str
    batch: int
    wall_time_s: float
    decoded_tokens: int  # generation-region columns: the same work in both modes, whatever the model writes
    throughput_tokens_per_s: float
    recompute_latency_s: float  # all refresh forwards of the run
    step_time_s: float  # all in-block forwards
    selection_time_s: float
    peak_kv_pages: int
    peak_kv_bytes: int
    model_flops: int = 0  # useful model arithmetic of the run (acache_lab.bench.flops)
    refreshes: int = 0  # batched refresh forwards
    selecting_refresh_s: float = 0.0  # of them, those that chose anchors inside the forward (anchor_pass="one")
    selecting_refreshes: int = 0
    #: the peak bytes of the in-block steps' rotated K/V copies outside the pool (CPU: ``reuse_step_keys``), the
    #: same size in both modes, since an in-block step of either attends to every other column
    peak_step_key_bytes: int = 0

    @property
    def model_flops_per_s(self) -> float:
        return self.model_flops / self.wall_time_s if self.wall_time_s > 0 else 0.0


@dataclass
class Comparison:
    batch: int
    recompute_reduction: float
    recompute_reduction_ideal: float
    throughput_gain: float
    throughput_gain_ideal: float
    peak_kv_reduction: float
    peak_kv_reduction_ideal: float
    #: the peak K/V held in all, the pool's pages and the in-block steps' copies (the same reduction where none)
    peak_memory_reduction: float = math.nan

    def fractions(self) -> dict[str, float]:
        """Each measured ratio over its ideal; NaN where the ideal is zero (nothing to reach)."""
        def over(measured: float, ideal: float) -> float:
            return measured / ideal if ideal else math.nan

        return {"recompute": over(self.recompute_reduction, self.recompute_reduction_ideal),
                "throughput": over(self.throughput_gain, self.throughput_gain_ideal),
                "memory": over(self.peak_kv_reduction, self.peak_kv_reduction_ideal)}


def make_requests(model: DiffusionLM, w: Workload, n: int, seed: int) -> list[AffixPrompt]:
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    special = {cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id}

    def tokens(k: int) -> list[int]:
        return [t if t not in special else 1 for t in torch.randint(0, cfg.vocab_size, (k,), generator=gen).tolist()]

    affix = tokens(w.affix_len)
    return [AffixPrompt.from_spans(affix + tokens(w.question_len), None, [(0, w.affix_len, "shots")])
            for _ in range(n)]


def make_task_requests(model_dir: str, n: int, sentences: int, seed: int) -> tuple[list[AffixPrompt], Workload]:
    """Part (i): the shipped model's own workload. One held-out qa1 story (the shared affix) asked about by
    ``n`` requests in the prefix layout; gen is qa1's answer region in one block, a step per column."""
    import random

    from acache.models.tokenizer import Tokenizer
    from acache_lab.tasks.generators import qa1
    from acache_lab.tasks.render import answer_length, render_prompts

    story = qa1(random.Random(f"bench:{seed}"), sentences, questions=8)
    prompts = render_prompts(Tokenizer.from_dir(model_dir), [story[i % len(story)] for i in range(n)], "prefix")
    span = prompts[0].affixes[0]
    question = len(prompts[0].token_ids) - span.length
    gen = answer_length("qa1")
    return prompts, Workload(span.length, question, gen, gen, gen, 0.2)


def workload_params(w: Workload, reuse: bool, prune: dict | None = None) -> SamplingParams:
    """The workload's parameters; ``prune`` adds FOCUS, far-mask, probe-step and anchor-query fields
    (``focus_layers``, ...). Every column of the region is decoded (``ignore_eos``), as the Fast-dLLM-style loop
    decodes it and as tokens/s counts it (``bench decode`` does the same): a mode whose answers reached an EOS block
    sooner did less work."""
    extra = {"anchor_pass": w.anchor_pass} if reuse and w.anchor_pass and "probe_step" not in (prune or {}) else {}
    return SamplingParams(gen_length=w.gen_length, block_length=w.block_length, steps=w.steps,
                          remasking="low_confidence", selector=w.selector if reuse else None, anchor_ratio=w.ratio,
                          ignore_eos=True,
                          **extra, **(prune or {}))


def mixed_params(w: Workload, n: int) -> list[SamplingParams]:
    """A heterogeneous batch: generation regions of a quarter, half and all of ``w.gen_length`` (4 tokens a
    step, as the workload) crossed with anchor ratios 0.1, 0.2 and 0.5, in turn."""
    out = []
    for i in range(n):
        gen = max(w.block_length, w.gen_length // [4, 2, 1][i % 3] // w.block_length * w.block_length)
        blocks = gen // w.block_length
        steps = max(blocks, gen // 4 // blocks * blocks)
        out.append(SamplingParams(gen_length=gen, block_length=w.block_length, steps=steps,
                                  remasking="low_confidence", selector=w.selector, anchor_pass=w.anchor_pass,
                                  anchor_ratio=[0.1, 0.2, 0.5][(i // 3) % 3], ignore_eos=True))
    return out


def cache_affix(engine: LLMEngine, prompt: AffixPrompt) -> None:
    """Puts ``prompt``'s first affix in ``engine``'s store: the steady state, in which every request after the
    first finds the shared affix cached."""
    shared, _ = engine.affixes.acquire(prompt.affix_ids(prompt.affixes[0]), "shots")
    engine.affixes.release(shared)


def admitted_engine(model: DiffusionLM, prompts: list[AffixPrompt], params: SamplingParams,
                    **config) -> LLMEngine:
    """A fresh engine (``config``: :class:`EngineConfig`'s fields, 4 GiB of pages unless given) with the shared affix
    cached where ``params`` reuse it and every prompt admitted, not yet stepped: what the probes time or count a
    step of. Each is fresh, so its first refresh writes pages touched for the first time, as every other's does."""
    # every prompt's whole canvas in one step, as run_mode budgets it: the default budget (16,384 tokens) would leave
    # part of a batch's first refresh to a later step, and the step timed or counted would not be the batch's
    canvas = sum(len(p.token_ids) + params.gen_length for p in prompts)
    engine = LLMEngine(model, EngineConfig(**{"kv_cache_memory": 4 << 30, "max_num_seqs": len(prompts),
                                              "max_num_batched_tokens": max(16384, canvas), **config}))
    if params.selector is not None:
        cache_affix(engine, prompts[0])
    for p in prompts:
        engine.add_request(p, params)
    return engine


def timed_steps(engine: LLMEngine, steps: int) -> list[float]:
    """Seconds of each of ``engine``'s next ``steps`` steps, the device synchronised before and after each."""
    times = []
    for _ in range(steps):
        _sync(engine.model.device)
        start = time.perf_counter()
        engine.step()
        _sync(engine.model.device)
        times.append(time.perf_counter() - start)
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(model: DiffusionLM, prompts: list[AffixPrompt], w: Workload, reuse: bool, batch: int,
             page_size: int, kv_bytes: int, params: list[SamplingParams] | None = None,
             mode: str | None = None) -> ModeResult:
    """Runs ``prompts`` (``params`` one per prompt, or the workload's) on a fresh engine of ``batch`` slots."""
    params = params or [workload_params(w, reuse)] * len(prompts)
    # both modes get the budget of a whole canvas a request: ACache's first refresh feeds the whole canvas when it
    # chooses its anchors inside it, and a smaller budget would push some of a batch's first refreshes to a later step
    tokens_per_refresh = batch * w.refresh_tokens(False)
    engine = LLMEngine(model, EngineConfig(page_size=page_size, kv_cache_memory=kv_bytes, max_num_seqs=batch,
                                           max_num_batched_tokens=max(16384, tokens_per_refresh)))
    if reuse:
        cache_affix(engine, prompts[0])
    engine.reset_metrics()
    copies = getattr(engine.runner, "step_keys", None)
    peak_copies, reading = 0, 0.0
    with FlopCounter(model) as counter:
        start = time.perf_counter()
        for p, sp in zip(prompts, params, strict=True):
            engine.add_request(p, sp)
        while engine.has_unfinished():
            engine.step()
            if copies is not None:  # read between steps, its time left out of the run's
                read_at = time.perf_counter()
                peak_copies = max(peak_copies, copies.nbytes())
                reading += time.perf_counter() - read_at
        wall = time.perf_counter() - start - reading
    s = engine.summary()
    decoded = sum(sp.gen_length for sp in params)
    return ModeResult(mode or ("acache" if reuse else "dual"), batch, wall, decoded,
                      decoded / wall, s["recompute_latency_total_s"], s["step_time_total_s"],
                      s["selection_latency_total_s"], s["peak_kv_pages"], s["peak_kv_bytes"], counter.flops,
                      s["refreshes"], s["selecting_refresh_total_s"], s["selecting_refreshes"], peak_copies)


def run_fastdllm(model: DiffusionLM, prompts: list[AffixPrompt], w: Workload, batch: int) -> ModeResult:
    """The same requests through the Fast-dLLM-style reference loop (:mod:`acache_lab.bench.fastdllm`), ``batch``
    at a time in lockstep, every prompt recomputed whole at each block start."""
    params = workload_params(w, False)
    wall = refresh = steps = 0.0
    with FlopCounter(model) as counter:
        for lo in range(0, len(prompts), batch):
            start = time.perf_counter()
            _, r, s = fastdllm_generate(model, [list(p.token_ids) for p in prompts[lo:lo + batch]], params)
            wall += time.perf_counter() - start
            refresh, steps = refresh + r, steps + s
    decoded = len(prompts) * w.gen_length
    return ModeResult("fast-dllm loop", batch, wall, decoded, decoded / wall, refresh, steps, 0.0, 0, 0, counter.flops)


def run_grouped(model: DiffusionLM, prompts: list[AffixPrompt], w: Workload, batch: int, page_size: int,
                kv_bytes: int, params: list[SamplingParams]) -> ModeResult:
    """The same requests as a mixed batch, each group of identical parameters run alone, one after another:
    what serving them would cost if only alike requests could share a batch."""
    groups: dict[SamplingParams, list[AffixPrompt]] = {}
    for p, sp in zip(prompts, params, strict=True):
        groups.setdefault(sp, []).append(p)
    runs = [run_mode(model, ps, w, True, batch, page_size, kv_bytes, [sp] * len(ps)) for sp, ps in groups.items()]
    wall = sum(r.wall_time_s for r in runs)
    decoded = sum(r.decoded_tokens for r in runs)
    return ModeResult("acache mixed, grouped", batch, wall, decoded, decoded / wall,
                      sum(r.recompute_latency_s for r in runs), sum(r.step_time_s for r in runs),
                      sum(r.selection_time_s for r in runs), max(r.peak_kv_pages for r in runs),
                      max(r.peak_kv_bytes for r in runs), sum(r.model_flops for r in runs))


def median_run(runs: list[ModeResult]) -> ModeResult:
    """The run of median wall time: on a tiny model one run lasts milliseconds and a single one is noise."""
    if not runs:
        raise ValueError("no runs to take the median of")
    return sorted(runs, key=lambda r: r.wall_time_s)[len(runs) // 2]


def compare(dual: ModeResult, acache: ModeResult, w: Workload, page_size: int, layers: int | None = None,
            ) -> Comparison:
    def pages(tokens: int) -> int:
        return -(-tokens // page_size)

    b = dual.batch
    ideal_pages_dual = b * pages(w.refresh_tokens(False))
    ideal_pages_acache = pages(w.affix_len) + b * pages(w.refresh_tokens(True))
    return Comparison(
        batch=b,
        recompute_reduction=1 - acache.recompute_latency_s / dual.recompute_latency_s,
        recompute_reduction_ideal=1 - w.refresh_tokens(True) / w.refresh_tokens(False),
        throughput_gain=acache.throughput_tokens_per_s / dual.throughput_tokens_per_s,
        throughput_gain_ideal=w.token_passes(False) / w.token_passes(True, layers),
        peak_kv_reduction=1 - acache.peak_kv_pages / dual.peak_kv_pages,
        peak_kv_reduction_ideal=1 - ideal_pages_acache / ideal_pages_dual,
        peak_memory_reduction=1 - (acache.peak_kv_bytes + acache.peak_step_key_bytes)
        / (dual.peak_kv_bytes + dual.peak_step_key_bytes),
    )


def selection_share(dual: ModeResult, acache: ModeResult) -> float | None:
    """What choosing anchors inside the refresh costs, in forwards: how much longer a selecting refresh batch runs
    than one of the same run's later refresh batches (fixed anchors), over a dual-cache refresh batch (a forward
    of the whole canvas). None when the run chose no anchors inside a refresh or had no later refresh. Read on the
    homogeneous workload, where every batch holds the same requests."""
    plain = acache.refreshes - acache.selecting_refreshes
    if not acache.selecting_refreshes or not plain or not dual.refreshes:
        return None
    later = (acache.recompute_latency_s - acache.selecting_refresh_s) / plain
    forward = dual.recompute_latency_s / dual.refreshes
    return (acache.selecting_refresh_s / acache.selecting_refreshes - later) / forward


def _secs(x: float) -> str:
    """Seconds with two decimals, or four under a second (a tiny model's runs last milliseconds)."""
    return f"{x:.2f}" if x >= 1 or x == 0 else f"{x:.4f}"


def markdown(results: list[ModeResult], comparisons: list[Comparison], peak_flops: float | None = None) -> str:
    lines = ["| batch | mode | wall s | tokens/s | recompute s | in-block s | selection s | peak KV pages "
             "| peak KV MiB | step-key copies MiB | model GFLOP/s | of peak |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        share = f"{100 * r.model_flops_per_s / peak_flops:.1f}%" if peak_flops else "-"
        lines.append(f"| {r.batch} | {r.mode} | {_secs(r.wall_time_s)} | {r.throughput_tokens_per_s:.2f} | "
                     f"{_secs(r.recompute_latency_s)} | {_secs(r.step_time_s)} | {_secs(r.selection_time_s)} | "
                     f"{r.peak_kv_pages} | {r.peak_kv_bytes / 2**20:.1f} | {r.peak_step_key_bytes / 2**20:.1f} | "
                     f"{r.model_flops_per_s / 1e9:.1f} | {share} |")
    lines += ["", "| batch | recompute latency (ideal) | throughput (ideal) | peak KV pages (ideal) "
              "| peak K/V held, copies included | % of ideal (r / t / m) |", "|---:|---:|---:|---:|---:|---:|"]
    for c in comparisons:
        f = c.fractions()
        lines.append(f"| {c.batch} | {-100 * c.recompute_reduction:+.1f}% "
                     f"({-100 * c.recompute_reduction_ideal:+.1f}%) | "
                     f"{c.throughput_gain:.2f}x ({c.throughput_gain_ideal:.2f}x) | "
                     f"{-100 * c.peak_kv_reduction:+.1f}% ({-100 * c.peak_kv_reduction_ideal:+.1f}%) | "
                     f"{'-' if math.isnan(c.peak_memory_reduction) else f'{-100 * c.peak_memory_reduction:+.1f}%'} | "
                     + " / ".join("-" if math.isnan(v) else f"{100 * v:.0f}%" for v in f.values()) + " |")
    return "\n".join(lines)


def mixed_markdown(homogeneous: ModeResult, mixed: ModeResult, grouped: ModeResult) -> str:
    """The heterogeneous batch against the homogeneous one and against its own requests run group by group."""
    lines = ["| batch | run | decoded tokens | wall s | tokens/s | recompute s | in-block s | selection s "
             "| peak KV pages |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in (homogeneous, mixed, grouped):
        lines.append(f"| {r.batch} | {r.mode} | {r.decoded_tokens} | {_secs(r.wall_time_s)} | "
                     f"{r.throughput_tokens_per_s:.2f} | {_secs(r.recompute_latency_s)} | {_secs(r.step_time_s)} | "
                     f"{_secs(r.selection_time_s)} | {r.peak_kv_pages} |")
    tps = mixed.throughput_tokens_per_s
    lines.append(f"\nmixed / homogeneous tokens/s: {tps / homogeneous.throughput_tokens_per_s:.2f}x; "
                 f"mixed / grouped: {tps / grouped.throughput_tokens_per_s:.2f}x")
    return "\n".join(lines)


def plot(comparisons: list[Comparison], path: Path, ratio: float = 0.2) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    batches = [str(c.batch) for c in comparisons]
    panels = [("recompute latency reduction (%)", [100 * c.recompute_reduction for c in comparisons],
               [100 * c.recompute_reduction_ideal for c in comparisons]),
              ("throughput gain (x)", [c.throughput_gain for c in comparisons],
               [c.throughput_gain_ideal for c in comparisons]),
              ("peak KV reduction (%)", [100 * c.peak_kv_reduction for c in comparisons],
               [100 * c.peak_kv_reduction_ideal for c in comparisons])]
    for ax, (title, measured, ideal) in zip(axes, panels, strict=True):
        x = range(len(batches))
        ax.bar([i - 0.2 for i in x], measured, width=0.4, label="measured")
        ax.bar([i + 0.2 for i in x], ideal, width=0.4, label="ideal", alpha=0.5)
        ax.set_xticks(list(x), batches)
        ax.set_xlabel("batch size")
        ax.set_title(title, fontsize=10)
    axes[0].legend()
    fig.suptitle(f"ACache (ratio {ratio:g}) vs dual cache alone, same engine")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def batch_sizes(text: str) -> list[int]:
    """``1,4,16``: distinct positive batch sizes, in the order given."""
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes takes whole numbers separated by commas, not {text!r}") from None
    if not sizes or any(b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"--batch-sizes takes distinct positive batch sizes, not {text!r}")
    return sizes


#: ``--workload shape``'s options and their defaults; ``--workload tasks`` takes its shape from the task instead
SHAPE_OPTIONS = {"affix_len": 700, "question_len": 60, "gen_length": 256, "block_length": 32, "steps": 64}


def workload_options(args) -> None:
    """Fills in the options the workload reads, and refuses those it would ignore (they were dropped silently)."""
    given = [name for name in SHAPE_OPTIONS if getattr(args, name) is not None]
    if args.workload == "tasks" and given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"--workload tasks takes its shape from the task (its story, question and answer region): "
                         f"{flags} would be ignored; drop them, or use --workload shape")
    if args.workload != "tasks" and args.sentences is not None:
        raise ValueError("--sentences is the story length of --workload tasks; --workload shape would ignore it")
    if args.model and args.shape is not None:
        raise ValueError("--shape is the random model's shape; with --model it would be ignored")
    for name, default in SHAPE_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.sentences = 8 if args.sentences is None else args.sentences
    args.shape = "smollm2-135m" if args.shape is None else args.shape


def main(args) -> int:
    batch_sizes(args.batch_sizes)  # before the model loads
    workload_options(args)
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests must be at least 1, not {args.requests}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, not {args.repeats}")
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    if args.model:
        model = load_model(args.model, dtype=args.dtype, device=device)
        described = str(args.model)
    else:
        shape = SHAPES[args.shape]
        model = random_model("llada", shape, dtype, device, args.seed)
        described = f"random LLaDA at {args.shape} shape (" + ", ".join(f"{k}={v}" for k, v in shape.items()) + ")"
    w = Workload(args.affix_len, args.question_len, args.gen_length, args.block_length, args.steps, args.ratio,
                 args.selector, args.anchor_pass)
    if args.workload == "tasks":
        if not args.model:
            raise ValueError("--workload tasks runs on a trained model: pass --model (the shipped one)")
        sample, w = make_task_requests(args.model, 1, args.sentences, args.seed)
        w = replace(w, selector=args.selector, anchor_pass=args.anchor_pass, ratio=args.ratio)
        described += f"; task workload: one held-out qa1 story of {args.sentences} sentences shared by every request"
    else:
        sample = make_requests(model, w, 1, args.seed)
    # the ideal counts as the engine
    w = replace(w, exact=all(exact_affixes(model.config, sample[0], w.gen_length)),
                fresh=sum(fresh_affix_columns(model.config, sample[0], w.gen_length, shifted=model.shifted_logits)))
    batches = batch_sizes(args.batch_sizes)
    results, comparisons = [], []
    n_params = sum(p.numel() for p in model.parameters())

    def requests(b: int) -> tuple[list[AffixPrompt], Workload]:
        n = args.requests or b
        if args.workload == "tasks":
            prompts, _ = make_task_requests(args.model, n, args.sentences, args.seed)
            return prompts, w
        return make_requests(model, w, n, args.seed + b), w

    prune = {k: v for k, v in (("focus_layers", args.focus_layers), ("focus_ratio", args.focus_ratio),
                               ("far_mask_window", args.far_mask_window),
                               ("probe_step", True if args.probe_step else None),
                               ("anchor_query", args.anchor_query), ("anchor_depth", args.anchor_depth))
             if v is not None}
    if prune.keys() == {"focus_ratio"}:
        raise ValueError("--focus-ratio needs --focus-layers")
    pruned_name = "acache+" + "+".join(f"{k}={v}" for k, v in prune.items())
    workload_params(w, True, prune)  # a setting SamplingParams refuses is named before any mode runs
    # every timed mode: (name, model, ACache or not, pruning); compiled modes run on a compiled copy of the model,
    # so the eager and compiled engines are timed side by side in one run
    specs: list[tuple[str, DiffusionLM, bool, dict | None]] = [("dual", model, False, None),
                                                               ("acache", model, True, None)]
    if prune:
        specs.append((pruned_name, model, True, prune))
    if args.compile:
        compiled = copy.deepcopy(model)
        compiled.compile_layers()
        specs += [("dual compiled", compiled, False, None), ("acache compiled", compiled, True, None)]

    def run_spec(spec: tuple, prompts: list[AffixPrompt], wb: Workload, b: int) -> ModeResult:
        name, m, reuse, pr = spec
        return run_mode(m, prompts, wb, reuse, b, args.page_size, args.kv_cache_memory,
                        [workload_params(wb, True, pr)] * len(prompts) if pr else None, name)

    if args.fastdllm_loop and (model.shifted_logits or model.config.block_size is not None):
        raise ValueError("--fastdllm-loop runs LLaDA-style models (unshifted, bidirectional)")
    modes = [*specs, None] if args.fastdllm_loop else list(specs)  # None: the reference loop
    if args.warmup:  # untimed runs first, so no timed run pays for lazy initialisation, compilation or the first
        # touch of a batch size's buffers: every mode, the reference loop included, at every batch size, on one
        # batch of its requests (the first timed run at a new batch size was always the dual cache's)
        ahead = [(b, spec) for b in batches for spec in modes]
        for b, spec in tqdm(ahead, desc="bench warm-up (untimed)", unit="run"):
            prompts, wb = requests(b)
            if spec is None:
                run_fastdllm(model, prompts[:b], wb, b)
            else:
                run_spec(spec, prompts[:b], wb, b)
    with tqdm(total=len(specs) * len(batches) * args.repeats, desc="bench engine", unit="run") as bar:
        for b in batches:
            prompts, w = requests(b)
            runs: dict[str, list[ModeResult]] = {spec[0]: [] for spec in specs}
            if args.fastdllm_loop:
                runs["fast-dllm loop"] = []
            for repeat in range(args.repeats):  # interleaved, so drift on a noisy machine hits every mode alike,
                turn = repeat % len(modes)  # and each repeat starts with another mode
                for spec in modes[turn:] + modes[:turn]:
                    if spec is None:
                        runs["fast-dllm loop"].append(run_fastdllm(model, prompts, w, b))
                        continue
                    runs[spec[0]].append(run_spec(spec, prompts, w, b))
                    bar.update(1)
            best = {name: median_run(r) for name, r in runs.items()}
            results += list(best.values())
            comparisons.append(compare(best["dual"], best["acache"], w, args.page_size, model.config.num_layers))
    mixed = []
    if args.mixed:
        b = batches[-1]
        prompts, w = requests(b)
        params = mixed_params(w, b)
        for _ in tqdm(range(args.repeats), desc="bench mixed", unit="run"):
            mixed.append((run_mode(model, prompts, w, True, b, args.page_size, args.kv_cache_memory, params,
                                   "acache mixed"),
                          run_grouped(model, prompts, w, b, args.page_size, args.kv_cache_memory, params)))
        mixed = [median_run([m[0] for m in mixed]), median_run([m[1] for m in mixed])]
    header = (f"model: {described}, {n_params / 1e6:.0f}M parameters, {model.dtype}, {device}; affix {w.affix_len}, "
              f"question {w.question_len}, gen {w.gen_length}, block {w.block_length}, steps {w.steps} "
              f"(low-confidence), ratio {w.ratio}, selector {w.selector} "
              f"({SamplingParams(selector=w.selector, anchor_pass=w.anchor_pass).resolved_anchor_pass} pass), "
              f"page {args.page_size}; "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}; "
              f"median of {args.repeats} run(s) per mode, each repeat starting with the next mode"
              f"{', after an untimed warm-up of every mode at every batch size' if args.warmup else ''}")
    cfg = model.config
    peak = matmul_peak(model.dtype, device, 2048, cfg.hidden_size, cfg.intermediate_size)
    header += (f"; machine peak {peak / 1e9:.1f} GFLOP/s ({model.dtype} matmul 2048 x {cfg.hidden_size} x "
               f"{cfg.intermediate_size}, measured in this run)")
    table = markdown(results, comparisons, peak)
    speed = {(r.batch, r.mode): r.throughput_tokens_per_s for r in results}
    if prune:
        table += "\n\n" + "\n".join(
            f"batch {b}: {pruned_name} at {speed[(b, pruned_name)] / speed[(b, 'dual')]:.2f}x the dual cache's "
            f"tokens/s ({speed[(b, 'acache')] / speed[(b, 'dual')]:.2f}x for plain ACache)" for b in batches)
    shares = [(r.batch, selection_share(next(d for d in results if d.batch == r.batch and d.mode == "dual"), r))
              for r in results if r.mode == "acache"]
    if any(share is not None for _, share in shares):
        table += "\n\n" + "\n".join(
            f"batch {b}: selection inside the first refresh costs {share:.3f} of a forward (its refresh batch against "
            "a later one with the anchors fixed, over a dual-cache refresh)"
            for b, share in shares if share is not None)
    if args.fastdllm_loop:
        table += "\n\n" + "\n".join(
            f"batch {b}: ACache at {speed[(b, 'acache')] / speed[(b, 'fast-dllm loop')]:.2f}x the Fast-dLLM-style "
            f"loop's tokens/s (the engine's dual cache at {speed[(b, 'dual')] / speed[(b, 'fast-dllm loop')]:.2f}x)"
            for b in batches)
    if args.compile:
        table += "\n\n" + "\n".join(
            f"batch {b}: compiled / eager tokens/s: dual {speed[(b, 'dual compiled')] / speed[(b, 'dual')]:.2f}x, "
            f"ACache {speed[(b, 'acache compiled')] / speed[(b, 'acache')]:.2f}x; compiled ACache at "
            f"{speed[(b, 'acache compiled')] / speed[(b, 'dual compiled')]:.2f}x the compiled dual cache"
            for b in batches)
    if mixed:
        plain = next(r for r in results if r.mode == "acache" and r.batch == batches[-1])
        table += "\n\n" + mixed_markdown(plain, *mixed)
    print(header)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": header, "workload": asdict(w), "peak_flops_per_s": peak,
                                               "results": [asdict(r) for r in results],
                                               "comparisons": [asdict(c) for c in comparisons],
                                               "mixed": [asdict(r) for r in mixed]}, indent=2))
    if args.plot and plot(comparisons, Path(args.plot), w.ratio):
        print(f"plot: {args.plot}")
    return 0
