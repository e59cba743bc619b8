"""The one diffusion generation loop. Commit rule and cache policy are plugged in; nothing is copied.

Rows of a batch share one canvas (see :mod:`acache.decoding.canvas`); padding is never attended and
positions count each row's own tokens, so a row's result does not depend on its batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from acache.decoding.cache_policy import CachePolicy, make_cache_policy
from acache.decoding.canvas import Canvas, Layout, build_canvas
from acache.decoding.commit import commit_step, make_commit_rule
from acache.decoding.sampler import propose
from acache.models.base import DiffusionLM
from acache.sampling_params import SamplingParams


@dataclass
class GenerationStats:
    nfe: int = 0  # forward evaluations of the model
    refreshes: int = 0  # forwards that refreshed the cache (full canvas)
    forward_time_s: float = 0.0  # wall time inside model forwards and logits
    refresh_times_s: list[float] = field(default_factory=list)  # each refresh forward
    recomputed_tokens: list[int] = field(default_factory=list)  # tokens fed by each refresh (all rows)
    wall_time_s: float = 0.0


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated ids of each prompt, cut at the first stop token
    stats: GenerationStats = field(default_factory=GenerationStats)
    canvas: Canvas | None = None  # the final canvas


def truncate_at_stop(ids: list[int], stop_token_ids: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in stop_token_ids:
            return ids[:i]
    return ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(model: DiffusionLM, prompts: Sequence[Sequence[int] | Layout], params: SamplingParams,
             stop_token_ids: Sequence[int] = (), generators: list[torch.Generator | None] | None = None,
             policy: CachePolicy | None = None) -> GenerationResult:
    """Decodes ``params.gen_length`` tokens in each prompt's generation region, block by block.

    ``policy`` overrides the cache policy named by ``params.cache`` (the affix cache plugs in here).
    """
    if not prompts:
        return GenerationResult([])
    config = model.config
    limit = config.max_position_embeddings
    layouts = [Layout.of(p) for p in prompts]
    for i, lay in enumerate(layouts):
        if len(lay.token_ids) + params.gen_length > limit:
            raise ValueError(f"prompt {i} has {len(lay.token_ids)} tokens; with gen_length {params.gen_length} "
                             f"that exceeds the model's context of {limit} positions")
    device = model.device
    mask_id = config.mask_token_id
    canvas = build_canvas(layouts, params.gen_length, mask_id, config.pad_token_id, device)
    x = canvas.tokens
    rule = make_commit_rule(params)
    policy = policy or make_cache_policy(params.cache, params.refresh_interval)
    stats = GenerationStats()
    started = time.perf_counter()
    policy.begin(model, canvas)
    for b in range(params.num_blocks):
        start = canvas.gen_start + b * params.block_length
        end = start + params.block_length
        masked = x[:, start:end] == mask_id
        rule.begin_block(masked.sum(-1))
        step = 0
        while masked.any():
            plan = policy.plan(step, start, end, canvas.total)
            _sync(device)
            t0 = time.perf_counter()
            if isinstance(plan.cols, slice):
                ids, pos, valid = x[:, plan.cols], canvas.positions[:, plan.cols], canvas.valid[:, plan.cols]
            else:
                ids, pos = x.gather(1, plan.cols), canvas.positions.gather(1, plan.cols)
                valid = canvas.valid.gather(1, plan.cols) & plan.cols_valid
            if plan.forward is not None:
                out = plan.forward(ids, pos, valid)
            else:
                out = model(ids, pos, valid, past=plan.past, return_kv=plan.refresh)
            logits = model.logits(out.hidden, plan.block, valid)
            active = masked.any(-1).tolist() if params.temperature > 0 else None
            x0, conf = propose(logits, params.temperature, generators, active, mask_id)
            _sync(device)
            elapsed = time.perf_counter() - t0
            stats.forward_time_s += elapsed
            stats.nfe += 1
            if plan.refresh:
                stats.refreshes += 1
                stats.refresh_times_s.append(elapsed)
                stats.recomputed_tokens.append(int(valid.sum()))
                policy.store(out.kv, plan, start, end)
            x[:, start:end], masked = commit_step(rule, x[:, start:end], x0, conf, masked, step,
                                                  model.shifted_logits and policy.commits_block_head)
            step += 1
    stats.wall_time_s = time.perf_counter() - started
    stops = {config.eos_token_id, *stop_token_ids}
    generated = x[:, canvas.gen_start:canvas.gen_start + params.gen_length].tolist()
    return GenerationResult([truncate_at_stop(row, stops) for row in generated], stats, canvas)
