"""The one diffusion generation loop. Commit rule and cache policy are plugged in; nothing is copied.

Prompts of different lengths are left-padded so every row's generation region starts at the same
column; padding is never attended and positions count from each row's first real token, so a row's
result does not depend on its batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from acache.decoding.cache_policy import make_cache_policy
from acache.decoding.commit import make_commit_rule
from acache.decoding.sampler import propose
from acache.models.base import DiffusionLM
from acache.sampling_params import SamplingParams


@dataclass
class GenerationStats:
    nfe: int = 0  # forward evaluations of the model
    refreshes: int = 0  # forwards that refreshed the cache (full canvas)
    forward_time_s: float = 0.0  # wall time inside model forwards and logits
    wall_time_s: float = 0.0


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated ids of each prompt, cut at the first stop token
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class Canvas:
    tokens: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T] False on padding
    gen_start: int  # first column of the generation region


def build_canvas(prompts: Sequence[Sequence[int]], gen_length: int, mask_id: int, pad_id: int,
                 device: torch.device) -> Canvas:
    width = max(len(p) for p in prompts)
    b, total = len(prompts), width + gen_length
    tokens = torch.full((b, total), pad_id, dtype=torch.long)
    valid = torch.ones((b, total), dtype=torch.bool)
    pads = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):width] = torch.as_tensor(list(prompt), dtype=torch.long)
    tokens[:, width:] = mask_id
    cols = torch.arange(total)[None, :]
    valid = cols >= pads[:, None]
    positions = (cols - pads[:, None]).clamp_min(0)
    return Canvas(tokens.to(device), positions.to(device), valid.to(device), width)


def truncate_at_stop(ids: list[int], stop_token_ids: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in stop_token_ids:
            return ids[:i]
    return ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(model: DiffusionLM, prompts: Sequence[Sequence[int]], params: SamplingParams,
             stop_token_ids: Sequence[int] = (),
             generators: list[torch.Generator | None] | None = None) -> GenerationResult:
    """Decodes ``params.gen_length`` tokens after each prompt, block by block."""
    if not prompts:
        return GenerationResult([])
    config = model.config
    limit = config.max_position_embeddings
    for i, p in enumerate(prompts):
        if len(p) + params.gen_length > limit:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with gen_length {params.gen_length} that "
                             f"exceeds the model's context of {limit} positions")
    device = model.device
    mask_id = config.mask_token_id
    canvas = build_canvas(prompts, params.gen_length, mask_id, config.pad_token_id, device)
    x, total = canvas.tokens, canvas.tokens.shape[1]
    rule = make_commit_rule(params)
    policy = make_cache_policy(params.cache, params.refresh_interval)
    stats = GenerationStats()
    started = time.perf_counter()
    for b in range(params.num_blocks):
        start = canvas.gen_start + b * params.block_length
        end = start + params.block_length
        masked = x[:, start:end] == mask_id
        rule.begin_block(masked.sum(-1))
        step = 0
        while masked.any():
            plan = policy.plan(step, start, end, total)
            _sync(device)
            t0 = time.perf_counter()
            out = model(x[:, plan.cols], canvas.positions[:, plan.cols], canvas.valid[:, plan.cols],
                        past=plan.past, return_kv=plan.refresh)
            logits = model.logits(out.hidden, slice(start - plan.cols.start, end - plan.cols.start))
            x0, conf = propose(logits, params.temperature, generators)
            _sync(device)
            stats.forward_time_s += time.perf_counter() - t0
            stats.nfe += 1
            if plan.refresh:
                stats.refreshes += 1
                policy.store(out.kv, start, end)
            conf = torch.where(masked, conf, float("-inf"))
            if step == 0 and model.shifted_logits:
                # A shifted model cannot predict a block's first token from the block alone, so it is
                # committed on the block's first step, when the column before the block was fed too.
                conf[:, 0] = torch.where(masked[:, 0], float("inf"), conf[:, 0])
            commit = rule.select(conf, masked, step)
            x[:, start:end] = torch.where(commit, x0, x[:, start:end])
            masked &= ~commit
            step += 1
    stats.wall_time_s = time.perf_counter() - started
    stops = {config.eos_token_id, *stop_token_ids}
    generated = x[:, canvas.gen_start:].tolist()
    return GenerationResult([truncate_at_stop(row, stops) for row in generated], stats)
