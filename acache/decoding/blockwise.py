"""Decoding, block by block, a model that sees no later block and carries the finished ones in a cache of
its own: the state-space variant (:class:`~acache.models.ssm.SSMBlockDiffusionLM`, a state) and R2LM
(:class:`~acache.models.r2lm.R2LM`, attention K/V). Both offer ``empty_cache()``, ``extend(tokens, start,
cache) -> (logits, cache)`` and ``cache_bytes(cache)``.

The canvas (prompt, then ``gen_length`` masks) is walked block by block. The prompt's whole blocks enter
the cache in one forward; a block holding masks is denoised by the request's commit rule, each step a
forward of that block alone against the cache of the blocks before it; once it holds no mask it enters the
cache. With ``cache="none"`` every step instead runs the whole canvas up to the block's end from an empty
cache: the uncached path the cached one must equal token for token. A finished block holding a stop token
ends the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from acache.decoding.commit import commit_step, make_commit_rule
from acache.decoding.request_state import truncate_at_stop
from acache.decoding.sampler import propose
from acache.models.r2lm import R2LM
from acache.models.ssm import SSMBlockDiffusionLM
from acache.sampling_params import SamplingParams


@dataclass
class BlockwiseResult:
    token_ids: list[int]  # cut at the first stop token
    nfe: int  # forwards that decoded a step
    cache_bytes: int  # the cache's size once decoding ended


@torch.inference_mode()
def generate_blockwise(model: SSMBlockDiffusionLM | R2LM, prompt: Sequence[int], params: SamplingParams,
                       generator: torch.Generator | None = None) -> BlockwiseResult:
    """Decodes one request. Decoding follows the model's own blocks (the first may start inside the prompt's
    last block), so ``params.block_length`` must name them: the model's block size, or the whole region."""
    cfg = model.config
    if params.block_length not in (cfg.block_size, params.gen_length):
        raise ValueError(f"this model decodes its own blocks of {cfg.block_size} positions: set block_length="
                         f"{cfg.block_size} or the whole gen_length (got {params.block_length})")
    if params.affix_policy is not None:
        raise ValueError("affix reuse is not implemented for this family (its cache is built block by block)")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if not prompt or bad:
        raise ValueError("prompt must be a non-empty list of token ids in the vocabulary"
                         + (f" (got {bad[0]})" if bad else ""))
    device = model.embed.weight.device
    if generator is None:
        generator = params.generator(device, default_seed=0)
    tokens = torch.tensor([*prompt, *[cfg.mask_token_id] * params.gen_length], device=device)
    gen_start, total, size = len(prompt), len(prompt) + params.gen_length, cfg.block_size
    stops = {cfg.eos_token_id, *params.stop_token_ids}
    cached = params.cache != "none"
    rule = make_commit_rule(params)
    cache = model.empty_cache()
    first = gen_start // size * size
    if cached and first:
        _, cache = model.extend(tokens[:first], 0, cache)
    nfe = 0
    for start in range(first, total, size):
        end = min(start + size, total)
        masked = tokens[start:end] == cfg.mask_token_id
        masked[:max(0, gen_start - start)] = False  # the prompt's own tail is never rewritten
        rule.begin_block(masked.sum()[None])
        step = 0
        while bool(masked.any()):
            if cached:
                logits, _ = model.extend(tokens[start:end], start, cache)
            else:
                logits = model.extend(tokens[:end], 0, model.empty_cache())[0][start:end]
            x0, conf = propose(logits[None], params.temperature, [generator] if generator is not None else None,
                               mask_token_id=cfg.mask_token_id)
            block, left = commit_step(rule, tokens[None, start:end], x0, conf, masked[None], step, False)
            tokens[start:end], masked = block[0], left[0]
            step += 1
            nfe += 1
        if not stops.isdisjoint(tokens[max(start, gen_start):end].tolist()):
            break
        if cached:
            _, cache = model.extend(tokens[start:end], start, cache)
    out = truncate_at_stop(tokens[gen_start:].tolist(), stops)
    return BlockwiseResult(out, nfe, model.cache_bytes(cache))
